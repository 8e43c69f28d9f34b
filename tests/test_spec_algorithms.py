"""N-gram lookup, a standalone draft model, EAGLE-3 and EAGLE heads through the offline LLM on the tiny Llama
(CPU, float32, random weights; heads in the published checkpoint layouts, tests/spec_heads.py): greedy tokens and
logprobs equal those without speculation (prefix caching on, a second pass hitting it; chunked prefill), seeded
and penalised sampling are unchanged, the target as its own draft model has every draft accepted, and the
n-gram proposer copies the continuation of the longest recurring suffix."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import spec_fixtures
from spec_fixtures import (
    NEW,
    PROMPTS,
    SETUPS,
    generate,
    logprobs_of,
    make_llm,
    seeded_and_penalised_unchanged,
    spec_kwargs,
)
from spec_heads import Eagle3Reference, captured_states

from appliance import SamplingParams
from appliance.executor.speculative_ngram import ngram_propose

one_thread, drafters, reference = spec_fixtures.one_thread, spec_fixtures.drafters, spec_fixtures.reference


def test_ngram_proposes_what_followed_the_longest_recurring_suffix() -> None:
    t = np.array([1, 2, 3, 4, 5, 1, 2, 3, 9, 1, 2, 3])
    assert ngram_propose(t, 1, 3, 3) == [9, 1, 2]  # the latest earlier [1, 2, 3]
    assert ngram_propose(t, 1, 3, 5) == [9, 1, 2, 3]  # runs into the end of the history
    assert ngram_propose(np.array([7, 1, 2, 8, 2]), 1, 3, 2) == [8, 2]  # only the one-token suffix recurs
    assert ngram_propose(np.array([7, 1, 2, 8, 2]), 2, 3, 2) == []  # ... shorter than prompt_lookup_min
    assert ngram_propose(np.array([1, 2, 3]), 1, 3, 3) == [] and ngram_propose(np.array([5]), 1, 3, 3) == []


@pytest.mark.parametrize("algorithm,key", SETUPS)
@pytest.mark.parametrize("setup", [{"enable_prefix_caching": True},
                                   {"enable_prefix_caching": False, "chunked_prefill_size": 8}])
def test_greedy_tokens_and_logprobs_equal_without_speculation(tiny_model: Path, drafters: dict[str, Path],
                                                              reference: list[Any], algorithm: str, key: str | None,
                                                              setup: dict[str, Any]) -> None:
    llm = make_llm(tiny_model, **spec_kwargs(algorithm, drafters.get(key or "")), **setup)
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    for _ in range(2 if setup["enable_prefix_caching"] else 1):  # the second pass hits the prefix cache
        for o, ref in zip(generate(llm, params), reference):
            assert o.token_ids == ref.token_ids
            assert logprobs_of(o) == pytest.approx(logprobs_of(ref), abs=1e-4)
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens >= stats.spec_num_drafts
    assert llm.engine.check_accounting().ok
    if setup["enable_prefix_caching"]:
        assert stats.prefix_hit_tokens > 0


def test_the_target_as_its_own_draft_model_has_every_draft_accepted(tiny_model: Path, reference: list[Any]) -> None:
    llm = make_llm(tiny_model, **spec_kwargs("STANDALONE", tiny_model))
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_mean_accepted_length > 3.0  # 3 drafts + 1 per verification, less the ends of requests


@pytest.mark.parametrize("algorithm,key", [("NGRAM", None), ("STANDALONE", "draft"), ("EAGLE3", "eagle3")])
def test_seeded_and_penalised_sampling_is_unchanged(tiny_model: Path, drafters: dict[str, Path], algorithm: str,
                                                    key: str | None) -> None:
    llm = seeded_and_penalised_unchanged(tiny_model, drafters, algorithm, key)
    assert llm.engine.stats().spec_num_drafts > 0


def test_a_drafter_of_the_wrong_kind_is_refused(tiny_model: Path, drafters: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="algorithm EAGLE3 needs Eagle3Head"):
        make_llm(tiny_model, **spec_kwargs("EAGLE3", drafters["draft"]))
    with pytest.raises(ValueError, match="algorithm STANDALONE needs an ordinary model"):
        make_llm(tiny_model, **spec_kwargs("STANDALONE", drafters["eagle3"]))
    with pytest.raises(ValueError, match="an EAGLE-3 head reads three layers of the target.s 2"):
        make_llm(tiny_model, eagle3_layers_to_capture=[0, 1, 5], **spec_kwargs("EAGLE3", drafters["eagle3"]))


def test_a_draft_model_with_another_kv_layout_gets_caches_of_its_shape(tiny_model: Path, reference: list[Any],
                                                                       make_tiny_model: Callable[..., Path]) -> None:
    """A draft with 4 KV heads of 8 (the target: 2 of 16): its caches take its shape, the block budget counts both."""
    other = make_tiny_model("llama", seed=3, num_hidden_layers=1, num_key_value_heads=4, head_dim=8)
    llm = make_llm(tiny_model, max_total_tokens=1024, **spec_kwargs("STANDALONE", other))
    runner = llm.executor.runner
    spec = runner.kv_spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 16)
    assert spec.drafter is not None and (spec.drafter.num_layers, spec.drafter.num_kv_heads, spec.drafter.head_dim) == (1, 4, 8)
    assert spec.bytes_per_block == 2 * 4 * 4 * (2 * 2 * 16 + 4 * 8)  # K and V, 4 tokens, float32
    assert runner.draft_model.model.layers[0].self_attn.attn.k_cache.shape[1:] == (4, 4, 8)
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert llm.engine.stats().spec_num_drafts > 0


# ---- EAGLE-3: the engine's drafts equal a from-scratch pass of the published head recurrence ------------------

@pytest.mark.parametrize("layers", [None, [0, 1, 1]])
def test_eagle3_drafts_equal_a_from_scratch_pass_of_the_head(make_tiny_model: Callable[..., Path],
                                                            drafters: dict[str, Path], layers: list[int] | None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """After every step (catch-up over accepted and rejected verifications, chained steps, a prefix hit), each
    request's drafts equal the reference head's run over its whole history: the loader's mapping of the
    published names, the capture of the target's layers and the chain's inputs are the published ones."""
    from appliance.executor.speculative_draft import EagleSpeculator

    seen: dict[tuple[int, ...], list[int]] = {}
    real = EagleSpeculator.complete_step

    def record(self: EagleSpeculator, *args: Any) -> Any:
        result = real(self, *args)
        for rid, drafts in self.drafts.items():
            seen[tuple(self.runner.requests[rid].token_ids)] = list(drafts)
        return result

    monkeypatch.setattr(EagleSpeculator, "complete_step", record)
    # four layers: the default capture is layers 0, 2 and 3 (a layer may also be listed twice)
    tiny_model = make_tiny_model("llama", seed=4, num_hidden_layers=4)
    chosen = {"eagle3_layers_to_capture": layers} if layers else {}
    llm = make_llm(tiny_model, **chosen, **spec_kwargs("EAGLE3", drafters["eagle3"]))
    layers = layers or [0, 2, 3]
    generate(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), [PROMPTS[3], PROMPTS[0]])
    generate(llm, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), [PROMPTS[3][:9] + [60, 61]])
    assert len(seen) >= 10 and llm.engine.stats().prefix_hit_tokens > 0
    assert len({t for d in seen.values() for t in d}) > 5  # the head's drafts vary: the comparison can fail
    for history, drafts in list(seen.items())[::3]:
        ref = Eagle3Reference(drafters["eagle3"], tiny_model)
        aux = captured_states(tiny_model, list(history), layers)
        fc = ref.w["fc.weight"]
        first, pre = ref.step(list(history[1:]), aux[:-1] @ fc.T)
        want = [int(first[-1])]
        h = pre[-1:]
        while len(want) < len(drafts):
            tok, h = ref.step([want[-1]], h)
            want.append(int(tok[0]))
        assert drafts == want, history


@pytest.mark.slow
def test_tensor_parallel_eagle3_equals_one_process_without_speculation(tiny_model: Path, drafters: dict[str, Path],
                                                                       reference: list[Any]) -> None:
    """Two CPU worker processes (gloo): the head is sharded like the target (its fc gathers its output, the draft
    vocabulary is split over the ranks), and the greedy tokens are the one-process ones."""
    llm = make_llm(tiny_model, tensor_parallel_size=2, **spec_kwargs("EAGLE3", drafters["eagle3"]))
    try:
        outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
        assert llm.engine.stats().spec_num_drafts > 0 and llm.engine.check_accounting().ok
    finally:
        llm.shutdown()


@pytest.mark.parametrize("algorithm,key", [("STANDALONE", "draft"), ("EAGLE3", "eagle3")])
def test_preemption_with_drafts_keeps_the_greedy_tokens(tiny_model: Path, drafters: dict[str, Path],
                                                        reference: list[Any], algorithm: str, key: str) -> None:
    """A pool too small for all four requests: preempted requests come back, their drafter caches are rebuilt
    by the recompute, and every output still equals the target's greedy tokens; the pool is whole afterwards."""
    drafter = tiny_model if algorithm == "STANDALONE" else drafters[key]  # accepted drafts: long verifications
    llm = make_llm(tiny_model, max_total_tokens=64, max_model_len=48, enable_prefix_caching=False,
                   schedule_conservativeness=0.0, **spec_kwargs(algorithm, drafter))
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_drafts > 0 and stats.blocks_owned == 0
    assert llm.engine.check_accounting().ok
