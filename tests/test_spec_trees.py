"""Draft trees (speculative.eagle_topk > 1) on the tiny Llama (CPU, float32, random weights; heads in the published
layouts, tests/spec_heads.py): greedy tokens and logprobs equal those without speculation for EAGLE-3, EAGLE and a
standalone draft model at several tree shapes (prefix caching on, a second pass hitting it); seeded and penalised
sampling are unchanged; the target as its own draft model accepts whole paths; a standalone drafter's trees equal
a from-scratch search with the draft model in transformers; a forced (synthetic) acceptance of multi-node paths
leaves the target's cache equal to a plain prefill of the same tokens; aborts leave the pool whole; the tree
structure itself; and the settings that cannot run are refused with their key names."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB
from spec_heads import build_eagle3_head, build_eagle_head

from appliance import LLM, SamplingParams
from appliance.executor.draft_tree import DraftTree, select_tree
from appliance.executor.tree_verification import walk

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12, 13, 10, 11, 12, 13, 10, 11],
           list(range(40, 60)) + list(range(40, 50)), [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 50, 51]]
NEW = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def drafters(make_tiny_model: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("tree_drafters")
    return {"draft": make_tiny_model("llama", seed=1, num_hidden_layers=1),
            "eagle3": build_eagle3_head(out / "eagle3", TINY_VOCAB, 128),
            "eagle": build_eagle_head(out / "eagle", TINY_VOCAB)}


def make_llm(model: Path, **overrides: Any) -> LLM:
    return LLM(model=str(model), dtype="float32", block_size=4, skip_tokenizer_init=True, **overrides)


def tree_kwargs(algorithm: str, drafter: Path, topk: int, steps: int, tokens: int) -> dict[str, Any]:
    return {"speculative_algorithm": algorithm, "speculative_num_steps": steps, "speculative_eagle_topk": topk,
            "speculative_num_draft_tokens": tokens, "speculative_draft_model_path": str(drafter)}


def generate(llm: LLM, params: SamplingParams | list[SamplingParams], prompts: list[list[int]] = PROMPTS) -> list[Any]:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def logprobs_of(o: Any) -> list[float]:
    return [o.logprobs[i][t].logprob for i, t in enumerate(o.token_ids)]


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[Any]:
    return generate(make_llm(tiny_model), SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1))


# ---- the tree itself ----------------------------------------------------------------------------------------
def test_a_tree_orders_parents_first_and_masks_each_row_to_its_ancestors() -> None:
    # candidates: root children a (-0.1), b (-0.5); a's children c (-0.3), d (-0.9); b's child e (-0.6)
    scores = np.array([-0.1, -0.5, -0.3, -0.9, -0.6])
    tree = select_tree(scores, np.array([10, 11, 12, 13, 14]), np.array([-1, -1, 0, 0, 1]), np.array([1, 1, 2, 2, 2]),
                       4)
    assert tree == DraftTree((10, 12, 11, 14), (-1, 0, -1, 2))
    offsets, bits = tree.chunk_rows()
    assert offsets.tolist() == [0, 1, 2, 1, 2]
    assert bits.tolist() == [0b1, 0b11, 0b111, 0b1001, 0b11001]
    assert tree.pruned(2) == DraftTree((10, 12), (-1, 0)) and tree.children() == [[1, 3], [2], [], [4], []]
    assert tree.heights() == [2, 1, 0, 1, 0]
    assert tree.longest_path(5) == [0, 1, 2] and tree.longest_path(1) == [0, 1]
    deeper = DraftTree((10, 11, 12), (-1, -1, 1))  # the root's best child is a leaf: the path goes via the other
    assert deeper.longest_path(3) == [0, 2, 3]
    # the walk follows the samples: root samples 11 (node 2 = row 3), which samples 14 (row 4), which ends it
    assert walk(tree, [11, 0, 0, 14, 99]) == [0, 3, 4]
    assert walk(tree, [99, 0, 0, 0, 0]) == [0]


def test_equal_scores_keep_a_parent_before_its_child() -> None:
    tree = select_tree(np.array([0.0, 0.0, -1.0]), np.array([5, 6, 7]), np.array([-1, 0, 1]), np.array([1, 2, 3]), 2)
    assert tree == DraftTree((5, 6), (-1, 0))


def test_a_search_feeds_each_frontier_node_its_own_ancestors() -> None:
    """The drafter's tree steps, with a scripted drafter: token 3's two children beat every other candidate, so
    both nodes of the last frontier descend from the first frontier's node 0 (not one from each): their masks name
    that node and themselves, they take its hidden row, sit at depth 2's position and in the next scratch slots."""
    from appliance.engine.sampling_params import SamplingParams as Params
    from appliance.executor.request_table import RequestState
    from appliance.executor.tree_drafting import TreeDrafter

    v = 8
    prefs = {3: {1: 0.0, 2: -0.5}, 5: {6: -3.0, 7: -3.5}, 1: {4: -0.2, 0: -0.3}, 2: {4: -0.1, 7: -0.4}}
    seen: list[tuple[list[int], list[int], Any, list[float]]] = []

    def logits_of(tokens: list[int]) -> torch.Tensor:
        out = torch.full((len(tokens), v), -20.0)
        for r, t in enumerate(tokens):
            for c, lp in prefs[t].items():
                out[r, c] = lp
        return out

    def step(tokens: torch.Tensor, positions: torch.Tensor, meta: Any, hidden: torch.Tensor) -> Any:
        seen.append((tokens.tolist(), positions.tolist(), meta, hidden[:, 0].tolist()))
        return logits_of(tokens.tolist()), tokens[:, None].float().expand(-1, 4) + 100.0  # pre row: its token

    state = RequestState("r", list(range(10)), 5, 9, [7, 3, 8, 2, 6], Params())
    first = torch.full((1, v), -20.0)
    first[0, 3], first[0, 5] = 0.0, -1.0
    drafter = TreeDrafter(2, 3, 6, 4, torch.device("cpu"))
    tree, = drafter.draft(step, [state], first, [9], torch.full((1, 4), 7.0), None)
    (t2, p2, m2, h2), (t3, p3, m3, h3) = seen
    assert t2 == [3, 5] and p2 == [9, 9] and h2 == [7.0, 7.0]  # depth 1, the catch-up's hidden row
    assert m2.tree.tree_mask.tolist() == [0b01, 0b10] and m2.tree.tree_width.tolist() == [2]
    assert t3 == [1, 2] and p3 == [10, 10] and h3 == [103.0, 103.0]  # both under token 3: its pre row
    assert m3.tree.tree_mask.tolist() == [0b0101, 0b1001] and m3.tree.tree_width.tolist() == [4]
    assert m3.prefill_seq_lens.tolist() == [13]
    bs, blocks = 4, state.block_ids
    assert m3.slot_mapping.tolist() == [blocks[k // bs] * bs + k % bs for k in (11, 12)]
    # cumulative log-probabilities: 3 -0.31, 1 -0.79, 2 -1.29, 5 -1.31, 4 under 1 -1.43, 0 under 1 -1.53, 6 under 5
    # -1.79, 4 under 2 -1.84: the best 6
    assert tree == DraftTree((3, 1, 2, 5, 4, 0), (-1, 0, 0, -1, 1, 1))


def test_a_tree_chunk_runs_at_depths_in_its_own_slots_under_its_mask() -> None:
    """A step's inputs with a decode, a plain chunk and a tree verification (the root and three nodes, one of them
    a grandchild): the tree's rows take positions start + depth and slots start + row, the prefill rows their
    masks (none for the plain chunk)."""
    from appliance.engine.sampling_params import SamplingParams as Params
    from appliance.executor.input_batch import Chunk, build_inputs
    from appliance.executor.request_table import RequestState

    def state(rid: str, n: int, blocks: list[int]) -> RequestState:
        return RequestState(rid, list(range(100, 100 + n)), 2, 0, blocks, Params())

    tree = DraftTree((7, 8, 9), (-1, 0, -1))
    chunks = [Chunk(state("d", 6, [4, 5]), 5, 1, True), Chunk(state("p", 3, [9]), 0, 3, False),
              Chunk(state("t", 10, [1, 3, 2]), 6, 4, True, tree)]
    inputs = build_inputs(chunks, 4, torch.device("cpu"))
    assert inputs.positions.tolist() == [5, 0, 1, 2, 6, 7, 8, 7]
    assert inputs.meta.slot_mapping.tolist() == [5 * 4 + 1, 36, 37, 38, 3 * 4 + 2, 3 * 4 + 3, 2 * 4, 2 * 4 + 1]
    assert inputs.meta.tree.tree_width.tolist() == [0, 4]
    assert inputs.meta.tree.tree_mask.tolist()[3:] == [0b1, 0b11, 0b111, 0b1001]
    with pytest.raises(ValueError, match="cannot verify a tree of 3 nodes"):
        build_inputs([Chunk(state("t", 10, [1, 3, 2]), 5, 5, True, tree)], 4, torch.device("cpu"))


def test_random_rows_emit_the_targets_distribution() -> None:
    """Random rows: every emitted token is a sample of the target's distribution given the tokens before it, so a
    verification's emitted sequence has the probability of sampling it token by token (synthetic distributions
    per path; the tree holds tokens 0 and 1 under the root and 2 under 0)."""
    from appliance.engine.sampling_params import SamplingParams as Params
    from appliance.executor.request_table import RequestState
    from appliance.executor.sampler import SampleResult
    from appliance.executor.tree_verification import verify_trees

    gen = torch.Generator().manual_seed(0)
    table = {(): [0.4, 0.3, 0.2, 0.1], (0,): [0.1, 0.2, 0.5, 0.2], (1,): [0.25, 0.25, 0.25, 0.25],
             (0, 2): [0.7, 0.1, 0.1, 0.1]}

    def sample(logits: torch.Tensor, rows: list[Any]) -> list[SampleResult]:
        return [SampleResult(int(torch.multinomial(torch.tensor(table[tuple(r.path)]), 1, generator=gen)))
                for r in rows]

    tree = DraftTree((0, 1, 2), (-1, -1, 0))
    counts: dict[tuple[int, ...], int] = {}
    n = 20000
    for _ in range(n):
        state = RequestState("r", [9, 9, 0, 1, 2], 2, 1, [0], Params(temperature=1.0))
        (kept, _), = verify_trees(sample, torch.zeros(4, 4), [(state, tree)])
        key = tuple(x.token_id for x in kept)
        counts[key] = counts.get(key, 0) + 1

    def exact(seq: tuple[int, ...]) -> float:
        prob, path = 1.0, ()
        for t in seq:
            prob *= table[path][t]
            path = path + (t,)
        return prob

    assert sum(exact(k) for k in counts) == pytest.approx(1.0)  # only reachable sequences were emitted
    for key, c in counts.items():
        assert abs(c / n - exact(key)) < 4 * (exact(key) * (1 - exact(key)) / n) ** 0.5 + 1e-3, key


# ---- through the offline LLM ---------------------------------------------------------------------------------
SHAPES = [("EAGLE3", "eagle3", 2, 3, 6), ("EAGLE3", "eagle3", 4, 3, 8), ("EAGLE3", "eagle3", 3, 2, 4),
          ("EAGLE", "eagle", 2, 3, 5), ("STANDALONE", "draft", 2, 3, 7)]


@pytest.mark.parametrize("algorithm,key,topk,steps,tokens", SHAPES)
def test_greedy_tokens_and_logprobs_equal_without_speculation(tiny_model: Path, drafters: dict[str, Path],
                                                              reference: list[Any], algorithm: str, key: str,
                                                              topk: int, steps: int, tokens: int) -> None:
    llm = make_llm(tiny_model, **tree_kwargs(algorithm, drafters[key], topk, steps, tokens),
                   enable_prefix_caching=True)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    for _ in range(2):  # the second pass hits the prefix cache
        for o, ref in zip(generate(llm, params), reference):
            assert o.token_ids == ref.token_ids
            assert logprobs_of(o) == pytest.approx(logprobs_of(ref), abs=1e-4)
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens > stats.spec_num_drafts  # trees, not one node
    assert llm.executor.runner.spec.trees is not None and llm.engine.check_accounting().ok
    assert stats.prefix_hit_tokens > 0


def test_padded_tree_steps_draft_the_same_trees(tiny_model: Path, drafters: dict[str, Path],
                                               reference: list[Any]) -> None:
    """A GPU runner pads a tree step's sequence count to a power of two with empty sequences (as its prefill
    batches): three requests draft in four sequences, with the same tokens."""
    llm = make_llm(tiny_model, **tree_kwargs("EAGLE3", drafters["eagle3"], 2, 3, 6))
    llm.executor.runner.spec.tree.pad_sequences = True
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    assert [o.token_ids for o in generate(llm, params, PROMPTS[:3])] == [r.token_ids for r in reference[:3]]


def test_chunked_prefill_keeps_the_greedy_tokens(tiny_model: Path, drafters: dict[str, Path],
                                                reference: list[Any]) -> None:
    """Prompts in chunks of 8 (a prompt's last chunk drafts the first tree beside other requests' chunks)."""
    llm = make_llm(tiny_model, **tree_kwargs("EAGLE3", drafters["eagle3"], 3, 2, 5), enable_prefix_caching=False,
                   chunked_prefill_size=8)
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert llm.engine.stats().spec_num_drafts > 0 and llm.engine.check_accounting().ok


def test_the_target_as_its_own_draft_model_accepts_its_best_paths(tiny_model: Path, reference: list[Any]) -> None:
    llm = make_llm(tiny_model, **tree_kwargs("STANDALONE", tiny_model, 2, 3, 6))
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.stats()
    # the root's best child is the target's own greedy token: every verification accepts it, and deeper nodes of
    # the best path too (the random model's flat distributions keep the best 5 nodes within depth 2)
    assert stats.spec_accepted_per_pos[0] == stats.spec_num_drafts and len(stats.spec_accepted_per_pos) >= 2
    assert stats.spec_mean_accepted_length > 2.5


@pytest.mark.parametrize("drafter", ["target", "eagle3"])
def test_seeded_and_penalised_sampling_is_unchanged(tiny_model: Path, drafters: dict[str, Path], drafter: str) -> None:
    params = [SamplingParams(temperature=0.9, top_k=20, seed=7, max_tokens=NEW, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=NEW, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=11, min_tokens=3, max_tokens=NEW),
              SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3, max_tokens=NEW,
                             ignore_eos=True)]
    base = generate(make_llm(tiny_model), params)
    kw = (tree_kwargs("STANDALONE", tiny_model, 3, 3, 8) if drafter == "target"
          else tree_kwargs("EAGLE3", drafters["eagle3"], 2, 3, 6))
    llm = make_llm(tiny_model, **kw)
    for o, ref in zip(generate(llm, params), base):
        assert o.token_ids == ref.token_ids
    assert llm.engine.stats().spec_num_accepted_tokens > 0 or drafter != "target"


def _search(model: Any, history: list[int], topk: int, steps: int, nodes: int) -> DraftTree:
    """The tree search written out over whole sequences with the transformers draft model: each node's
    children from a full causal pass over the history and its path."""
    def top(path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = model(torch.tensor([history + path])).logits[0, -1]
        return torch.log_softmax(logits.float(), -1).topk(topk)

    v, t = top([])
    cands = [(float(v[j]), 1, [int(t[j])], -1) for j in range(topk)]  # (score, depth, path, parent id)
    frontier = list(range(topk))
    for depth in range(2, steps + 1):
        children = []
        for f in frontier:
            v, t = top(cands[f][2])
            children += [(cands[f][0] + float(v[j]), depth, cands[f][2] + [int(t[j])], f) for j in range(topk)]
        first = len(cands)
        cands += children
        order = sorted(range(len(children)), key=lambda i: -children[i][0])[:topk]
        frontier = [first + i for i in order]
    return select_tree(np.array([c[0] for c in cands]), np.array([c[2][-1] for c in cands]),
                       np.array([c[3] for c in cands]), np.array([c[1] for c in cands]), nodes)


def test_a_draft_models_trees_equal_a_from_scratch_search(tiny_model: Path, drafters: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """After every step (catch-up over accepted and rejected paths), each request's tree equals the search run with
    the draft model over its whole history: the drafter's tree steps (scratch slots, depths as positions, the
    mask over fed nodes) compute what full causal passes over each path do."""
    from transformers import AutoModelForCausalLM

    from appliance.executor.speculative_drafts import Drafting

    seen: list[tuple[list[int], DraftTree]] = []
    real = Drafting._draft_trees

    def record(self: Drafting, states: list[Any], *args: Any) -> None:
        real(self, states, *args)
        seen.extend((list(s.token_ids), self.trees[s.request_id]) for s in states if s.request_id in self.trees)

    monkeypatch.setattr(Drafting, "_draft_trees", record)
    llm = make_llm(tiny_model, **tree_kwargs("STANDALONE", drafters["draft"], 2, 3, 6))
    generate(llm, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), PROMPTS[:2])
    assert len(seen) >= 8
    model = AutoModelForCausalLM.from_pretrained(str(drafters["draft"]), dtype=torch.float32).eval()
    for history, tree in seen[::2]:
        assert tree == _search(model, history, 2, 3, 5), history


def _eagle3_search(head: Path, target: Path, layers: list[int], history: list[int], topk: int, steps: int,
                   nodes: int) -> DraftTree:
    """The tree search with the EAGLE-3 head written out (test_spec_algorithms.Eagle3Reference) over whole
    sequences: each node's logits from the head's pass over the history's rows (token i + 1, fc of the target's
    captured states at i) and then the node's path (token, the previous row's pre-norm output)."""
    from test_spec_algorithms import Eagle3Reference, _captured

    aux = _captured(target, history, layers)
    d2t = Eagle3Reference(head, target).w["d2t"]

    def top(path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ref = Eagle3Reference(head, target)
        _, pre = ref.step(history[1:], aux[:-1] @ ref.w["fc.weight"].T)
        h = pre[-1:]
        for t in path:
            _, h = ref.step([t], h)
        v, d = torch.log_softmax(ref.logits[-1].float(), -1).topk(topk)
        return v, d + d2t[d]

    v, t = top([])
    cands = [(float(v[j]), 1, [int(t[j])], -1) for j in range(topk)]
    frontier = list(range(topk))
    for depth in range(2, steps + 1):
        children = []
        for f in frontier:
            v, t = top(cands[f][2])
            children += [(cands[f][0] + float(v[j]), depth, cands[f][2] + [int(t[j])], f) for j in range(topk)]
        first = len(cands)
        cands += children
        frontier = [first + i for i in sorted(range(len(children)), key=lambda i: -children[i][0])[:topk]]
    return select_tree(np.array([c[0] for c in cands]), np.array([c[2][-1] for c in cands]),
                       np.array([c[3] for c in cands]), np.array([c[1] for c in cands]), nodes)


def test_eagle3_trees_equal_a_from_scratch_search(tiny_model: Path, drafters: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The EAGLE-3 head's trees: each frontier node is fed its parent's pre-norm output (the rows gathered through
    the search), at its depth, under the mask over the fed nodes; equal to the head written out."""
    from appliance.executor.speculative_drafts import Drafting

    seen: list[tuple[list[int], DraftTree]] = []
    real = Drafting._draft_trees

    def record(self: Drafting, states: list[Any], *args: Any) -> None:
        real(self, states, *args)
        seen.extend((list(s.token_ids), self.trees[s.request_id]) for s in states if s.request_id in self.trees)

    monkeypatch.setattr(Drafting, "_draft_trees", record)
    llm = make_llm(tiny_model, **tree_kwargs("EAGLE3", drafters["eagle3"], 3, 3, 9))
    generate(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), PROMPTS[:3])
    assert len(seen) >= 6 and len({t for _, tree in seen for t in tree.tokens}) > 5
    from appliance.models.eagle import default_capture_layers

    layers = default_capture_layers(len(llm.executor.runner.model.model.layers))
    for history, tree in seen:
        assert tree == _eagle3_search(drafters["eagle3"], tiny_model, layers, history, 3, 3, 8), history


def _dense_kv(runner: Any, state: Any) -> torch.Tensor:
    """The target's K and V of a request's computed positions, every layer, in position order."""
    bs = runner.block_size
    slots = torch.tensor([state.block_ids[t // bs] * bs + t % bs for t in range(state.num_computed)])
    return torch.stack([c.flatten(0, 1)[slots] for layer in runner.model.attention_layers()
                        for c in layer.kv_cache()])


def _record_kv(runner: Any, into: dict[str, tuple[list[int], torch.Tensor]]) -> None:
    """After every step, each live request's computed tokens and their KV (the last snapshot stays)."""
    target = runner.spec if runner.spec is not None else runner
    real = target.execute

    def execute(plan: Any) -> Any:
        out = real(plan)
        for rid, state in runner.requests.items():
            into[rid] = (list(state.token_ids[: state.num_computed]), _dense_kv(runner, state))
        return out

    target.execute = execute


def test_forced_acceptance_leaves_the_cache_a_chain_leaves(tiny_model: Path, drafters: dict[str, Path]) -> None:
    """Accepted paths of several nodes, forced (the drafts are a random head's): the target's KV of every
    computed position equals a plain prefill of the same tokens, as after a chain; unmoved, the accepted nodes'
    KV would sit in the wrong slots."""
    llm = make_llm(tiny_model, **tree_kwargs("EAGLE3", drafters["eagle3"], 3, 3, 8),
                   speculative_synthetic_acceptance_length=3.5, speculative_enable_synthetic_acceptance=True)
    runner = llm.executor.runner
    snaps: dict[str, tuple[list[int], torch.Tensor]] = {}
    moved: list[int] = []
    real_compact = runner.spec._compact
    runner.spec._compact = lambda c, r, h, paths: (moved.extend(p[-1] - len(p) + 1 for p in paths.values()),
                                                   real_compact(c, r, h, paths))
    _record_kv(runner, snaps)
    generate(llm, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), PROMPTS[:2])
    assert llm.engine.stats().spec_mean_accepted_length > 2.5 and any(m > 0 for m in moved)  # paths off the diagonal
    plain = make_llm(tiny_model, enable_overlap_schedule=False)  # steps through runner.execute
    ref: dict[str, tuple[list[int], torch.Tensor]] = {}
    _record_kv(plain.executor.runner, ref)
    for tokens, kv in snaps.values():
        ref.clear()
        generate(plain, SamplingParams(temperature=0.0, max_tokens=1), [tokens])
        (want_tokens, want), = ref.values()
        assert want_tokens == tokens and len(tokens) > len(PROMPTS[0]) + 4
        torch.testing.assert_close(kv, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("algorithm,key", [("STANDALONE", "target"), ("EAGLE3", "eagle3")])
def test_preemption_and_the_models_length_keep_the_greedy_tokens(tiny_model: Path, drafters: dict[str, Path],
                                                                 reference: list[Any], algorithm: str,
                                                                 key: str) -> None:
    """A pool too small for all four requests (preempted requests come back, their drafter caches rebuilt by the
    recompute) and max_model_len just past the longest request (its last trees do not fit: they are skipped)."""
    drafter = tiny_model if key == "target" else drafters[key]
    llm = make_llm(tiny_model, max_total_tokens=64, max_model_len=48, enable_prefix_caching=False,
                   schedule_conservativeness=0.0, **tree_kwargs(algorithm, drafter, 2, 3, 6))
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0 and stats.blocks_owned == 0
    assert llm.engine.check_accounting().ok


@pytest.mark.slow
def test_tensor_parallel_trees_equal_one_process_without_speculation(tiny_model: Path, drafters: dict[str, Path],
                                                                     reference: list[Any]) -> None:
    """Two CPU worker processes (gloo): every rank builds the same trees from the gathered logits."""
    llm = make_llm(tiny_model, tensor_parallel_size=2, **tree_kwargs("EAGLE3", drafters["eagle3"], 3, 3, 8))
    try:
        outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        stats = llm.engine.stats()
        assert stats.spec_num_draft_tokens > stats.spec_num_drafts and llm.engine.check_accounting().ok
    finally:
        llm.shutdown()


def test_an_fp8_kv_cache_keeps_the_tokens_of_plain_decoding_on_it(tiny_model: Path) -> None:
    """The accepted nodes' KV moves as bytes (an fp8 cache has no index copy of its own): the target as its own
    draft model accepts multi-node paths, and the tokens are plain decoding's on the same fp8 cache."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    plain = [o.token_ids for o in generate(make_llm(tiny_model, kv_cache_dtype="fp8"), params)]
    llm = make_llm(tiny_model, kv_cache_dtype="fp8", **tree_kwargs("STANDALONE", tiny_model, 2, 3, 6))
    assert llm.executor.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    assert [o.token_ids for o in generate(llm, params)] == plain
    assert len(llm.engine.stats().spec_accepted_per_pos) >= 2


def test_aborts_mid_tree_keep_the_pool_whole(tiny_model: Path, drafters: dict[str, Path]) -> None:
    llm = make_llm(tiny_model, **tree_kwargs("EAGLE3", drafters["eagle3"], 2, 3, 6))
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    got: dict[str, int] = {}
    while eng.has_work():
        for d in eng.step():
            got[d.request_id] = got.get(d.request_id, 0) + len(d.new_token_ids)
        for rid in ("r1", "r3"):
            if got.get(rid, 0) >= 3 and eng.get_request(rid) is not None:
                assert eng.abort(rid)
                assert eng.check_accounting().ok
    assert got["r0"] == NEW and got["r2"] == NEW and got["r1"] < NEW
    assert eng.check_accounting().ok and eng.stats().spec_num_drafts > 0
    assert not llm.executor.runner.spec.trees or set(llm.executor.runner.spec.trees) <= {"r0", "r2"}


def test_structured_requests_decode_without_tree_drafts(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Grammar masks follow one chain of drafts: a structured request gets no tree (its output is unchanged and
    valid) while a plain request beside it verifies trees."""
    pytest.importorskip("xgrammar")
    from appliance.executor.speculative_drafts import Drafting
    from appliance.structured import StructuredSpec

    drafted_for: list[bool] = []  # per tree drafted: whether its request is structured
    real = Drafting._draft_trees

    def record(self: Drafting, states: list[Any], *args: Any) -> None:
        drafted_for.extend("structured" in (s.params.extra or {}) for s in states)
        real(self, states, *args)

    monkeypatch.setattr(Drafting, "_draft_trees", record)

    spec = StructuredSpec.regex("[a-z]{2,6}-[0-9]{1,3}( [a-z]{2,6}-[0-9]{1,3}){0,4}")
    params = [SamplingParams(temperature=0.0, max_tokens=24, extra={"structured": spec.to_dict()}),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    prompts = ["name: ab-12 cd-34", "Hello world, hello world, hello"]
    kw: dict[str, Any] = {"dtype": "float32", "block_size": 4}
    base = LLM(model=str(tiny_model), **kw).generate(prompts, params)
    llm = LLM(model=str(tiny_model), **kw, **tree_kwargs("STANDALONE", tiny_model, 2, 3, 6))
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [b.outputs[0].token_ids for b in base]
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens > stats.spec_num_drafts
    assert drafted_for and not any(drafted_for)


# ---- settings ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides,key", [
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 2}, "speculative.eagle_topk"),
    ({"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 2, "enable_overlap_schedule": True},
     "speculative.eagle_topk"),
    ({"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 2, "speculative_num_steps": 2,
      "speculative_num_draft_tokens": 8}, "speculative.num_draft_tokens"),
    ({"speculative_algorithm": "EAGLE3", "speculative_eagle_topk": 8, "speculative_num_steps": 3,
      "speculative_num_draft_tokens": 65}, "speculative.num_draft_tokens"),
])
def test_trees_that_cannot_run_are_refused_by_key(tiny_model: Path, drafters: dict[str, Path],
                                                  overrides: dict[str, Any], key: str) -> None:
    if overrides["speculative_algorithm"] == "EAGLE3":
        overrides = {**overrides, "speculative_draft_model_path": str(drafters["eagle3"])}
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        make_llm(tiny_model, **overrides)


# ---- GPU (Triton kernels, padded prefill batches, CUDA graphs for the plain steps) --------------------------
gpu = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_llm(path: Path, **overrides: Any) -> LLM:
    return LLM(model=str(path), device="cuda", dtype="float32", gpu_memory_utilization=0.3, block_size=16,
               attention_backend="triton", skip_tokenizer_init=True, **overrides)


@pytest.mark.parametrize("algorithm,key", [("STANDALONE", "target"), ("EAGLE3", "eagle3")])
@gpu[0]
@gpu[1]
def test_gpu_tree_greedy_parity(tiny_model: Path, drafters: dict[str, Path], algorithm: str, key: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    want = [o.outputs[0].token_ids for o in gpu_llm(tiny_model).generate(prompts, params)]
    drafter = tiny_model if key == "target" else drafters[key]
    llm = gpu_llm(tiny_model, **tree_kwargs(algorithm, drafter, 3, 3, 8))
    for _ in range(2):  # the second pass hits the prefix cache
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    stats = llm.engine.stats()
    assert stats.spec_num_accepted_tokens > 0 and llm.engine.check_accounting().ok and stats.prefix_hit_tokens > 0


@gpu[0]
@gpu[1]
def test_gpu_bf16_tree_with_forced_acceptance_completes(make_tiny_model: Any, drafters: dict[str, Path]) -> None:
    target = make_tiny_model("llama", seed=5, num_hidden_layers=4)
    llm = LLM(model=str(target), device="cuda", dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.3,
              skip_tokenizer_init=True, max_num_seqs=8, **tree_kwargs("EAGLE3", drafters["eagle3"], 4, 3, 8),
              speculative_enable_synthetic_acceptance=True, speculative_synthetic_acceptance_length=2.6)
    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + 3 * i))} for i in range(6)]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    stats = llm.engine.stats()
    assert 2.0 < stats.spec_mean_accepted_length < 3.2 and llm.engine.check_accounting().ok
