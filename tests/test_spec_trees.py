"""Draft trees (speculative.eagle_topk > 1) through the offline LLM on the tiny Llama (CPU, float32, random
weights; heads in the published layouts, tests/spec_heads.py): greedy tokens and logprobs equal those without
speculation for EAGLE-3, EAGLE and a standalone draft model at several tree shapes (prefix caching on, a second
pass hitting it; chunked prefill; padded tree steps); seeded and penalised sampling are unchanged; the target as its
own draft model accepts its best paths; preemption, max_model_len, two tensor-parallel ranks and an fp8 cache keep
the tokens; aborts leave the pool whole; structured requests get no trees; the settings that cannot run are
refused with their key names. The tree itself: tests/test_draft_tree.py; what trees draft and leave in the cache:
tests/test_spec_tree_drafts.py."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import spec_fixtures
import torch
from spec_fixtures import NEW, PROMPTS, generate, gpu_llm, logprobs_of, make_llm, seeded_and_penalised, tree_kwargs

from appliance import LLM, SamplingParams

one_thread, drafters, reference = spec_fixtures.one_thread, spec_fixtures.drafters, spec_fixtures.reference


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


def test_the_warm_up_runs_each_prefill_count_as_tree_verifications_too(tiny_model: Path, drafters: dict[str, Path],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the warm-up pays the prefill kernel's variants with a tree mask before serving (run here on the
    CPU runner: its model sees each count plain and as trees)."""
    from appliance.executor import warmup

    runner = make_llm(tiny_model, **tree_kwargs("EAGLE3", drafters["eagle3"], 2, 3, 6)).executor.runner
    seen: list[tuple[int, bool]] = []
    real = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda ids, pos, meta: (
        seen.append((meta.num_prefills, meta.tree is not None)), real(ids, pos, meta))[1])
    ticks: list[None] = []
    warmup._prefills(runner, [1, 2, 4], lambda: ticks.append(None))
    assert seen == [(1, False), (1, True), (2, False), (2, True), (4, False), (4, True)] and len(ticks) == 3


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
    params = seeded_and_penalised(NEW)
    base = generate(make_llm(tiny_model), params)
    kw = (tree_kwargs("STANDALONE", tiny_model, 3, 3, 8) if drafter == "target"
          else tree_kwargs("EAGLE3", drafters["eagle3"], 2, 3, 6))
    llm = make_llm(tiny_model, **kw)
    for o, ref in zip(generate(llm, params), base):
        assert o.token_ids == ref.token_ids
    assert llm.engine.stats().spec_num_accepted_tokens > 0 or drafter != "target"


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


@pytest.mark.parametrize("algorithm,key", [("STANDALONE", "target"), ("EAGLE3", "eagle3")])
@gpu[0]
@gpu[1]
def test_gpu_tree_greedy_parity(tiny_model: Path, drafters: dict[str, Path], algorithm: str, key: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # a 40-token prompt: two full blocks of 16, one left to hit once an EAGLE drafter gives back the last one
    prompts = [{"prompt_token_ids": p} for p in [*PROMPTS, list(range(40, 60)) * 2]]
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
