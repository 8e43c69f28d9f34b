"""What draft trees hold and leave behind, on the tiny Llama: a standalone draft model's and an EAGLE-3 head's trees
equal the tree search written out over whole sequences (transformers; the head from its published description),
and a forced (synthetic) acceptance of multi-node paths leaves the target's cache equal to a plain prefill of the
same tokens, as a chain's would."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import spec_fixtures
import torch
from spec_fixtures import PROMPTS, generate, make_llm, tree_kwargs
from spec_heads import Eagle3Reference, captured_states

from appliance import SamplingParams
from appliance.executor.draft_tree import DraftTree, select_tree

one_thread, drafters = spec_fixtures.one_thread, spec_fixtures.drafters


def _recorded_trees(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[int], DraftTree]]:
    """A list that fills with (token history, drafted tree) for every tree the drafter builds."""
    from appliance.executor.speculative_drafts import Drafting

    seen: list[tuple[list[int], DraftTree]] = []
    real = Drafting._draft_trees

    def record(self: Drafting, states: list[Any], *args: Any) -> None:
        real(self, states, *args)
        seen.extend((list(s.token_ids), self.trees[s.request_id]) for s in states if s.request_id in self.trees)

    monkeypatch.setattr(Drafting, "_draft_trees", record)
    return seen


def _best_first(top: Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]], topk: int, steps: int,
                nodes: int) -> DraftTree:
    """The search itself: the topk children (log-probabilities, ids) of each node from `top(path)`, the topk best
    of a depth expanded at the next, `nodes` of them selected."""
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


def _search(model: Any, history: list[int], topk: int, steps: int, nodes: int) -> DraftTree:
    """The tree search written out over whole sequences with the transformers draft model: each node's
    children from a full causal pass over the history and its path."""
    def top(path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logits = model(torch.tensor([history + path])).logits[0, -1]
        return torch.log_softmax(logits.float(), -1).topk(topk)

    return _best_first(top, topk, steps, nodes)


def test_a_draft_models_trees_equal_a_from_scratch_search(tiny_model: Path, drafters: dict[str, Path],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """After every step (catch-up over accepted and rejected paths), each request's tree equals the search run with
    the draft model over its whole history: the drafter's tree steps (scratch slots, depths as positions, the
    mask over fed nodes) compute what full causal passes over each path do."""
    from transformers import AutoModelForCausalLM

    seen = _recorded_trees(monkeypatch)
    llm = make_llm(tiny_model, **tree_kwargs("STANDALONE", drafters["draft"], 2, 3, 6))
    generate(llm, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True), PROMPTS[:2])
    assert len(seen) >= 8
    model = AutoModelForCausalLM.from_pretrained(str(drafters["draft"]), dtype=torch.float32).eval()
    for history, tree in seen[::2]:
        assert tree == _search(model, history, 2, 3, 5), history


def _eagle3_search(head: Path, target: Path, layers: list[int], history: list[int], topk: int, steps: int,
                   nodes: int) -> DraftTree:
    """The tree search with the EAGLE-3 head written out (spec_heads.Eagle3Reference) over whole
    sequences: each node's logits from the head's pass over the history's rows (token i + 1, fc of the target's
    captured states at i) and then the node's path (token, the previous row's pre-norm output)."""
    aux = captured_states(target, history, layers)
    d2t = Eagle3Reference(head, target).w["d2t"]

    def top(path: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        ref = Eagle3Reference(head, target)
        _, pre = ref.step(history[1:], aux[:-1] @ ref.w["fc.weight"].T)
        h = pre[-1:]
        for t in path:
            _, h = ref.step([t], h)
        v, d = torch.log_softmax(ref.logits[-1].float(), -1).topk(topk)
        return v, d + d2t[d]

    return _best_first(top, topk, steps, nodes)


def test_eagle3_trees_equal_a_from_scratch_search(tiny_model: Path, drafters: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The EAGLE-3 head's trees: each frontier node is fed its parent's pre-norm output (the rows gathered through
    the search), at its depth, under the mask over the fed nodes; equal to the head written out."""
    seen = _recorded_trees(monkeypatch)
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
    target, name = (runner.spec, "complete_step") if runner.spec is not None else (runner, "execute")
    real = getattr(target, name)

    def record(step: Any) -> Any:
        out = real(step)
        for rid, state in runner.requests.items():
            into[rid] = (list(state.token_ids[: state.num_computed]), _dense_kv(runner, state))
        return out

    setattr(target, name, record)


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
