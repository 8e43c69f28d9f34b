"""Overlap scheduling with speculative decoding through the offline LLM (CPU, float32): every drafter this build
has (n-gram, a standalone draft model, EAGLE-3 in both published layouts, EAGLE, DeepSeek-V3 MTP) gives the same
greedy tokens and logprobs as the target alone while the engine plans each step before the previous step's
accepted count is known; seeded and penalised sampling, stop tokens inside an accepted run, stop strings,
per-request max_tokens and preemption are unchanged, and the pool is whole afterwards."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import spec_fixtures
from spec_fixtures import (
    MTP_NEW,
    MTP_PROMPTS,
    NEW,
    SETUPS,
    delta_lengths,
    generate,
    logprobs_of,
    make_llm,
    oracle,
    seeded_and_penalised_unchanged,
    spec_kwargs,
    stop_case,
)

from appliance import LLM, SamplingParams

one_thread, drafters, reference = spec_fixtures.one_thread, spec_fixtures.drafters, spec_fixtures.reference
tiny_v3, mtp_reference, tiny_v3_tok = spec_fixtures.tiny_v3, spec_fixtures.mtp_reference, spec_fixtures.tiny_v3_tok

OVERLAP = {"enable_overlap_schedule": True}


def _overlapped(llm: LLM) -> LLM:
    assert llm.engine.overlap  # the setting reached the engine: steps really are planned ahead
    return llm


def _check_pool(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.spec_num_drafts > 0 and stats.blocks_owned == 0 and llm.engine.check_accounting().ok
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens


@pytest.mark.parametrize("algorithm,key", SETUPS)
@pytest.mark.parametrize("setup", [{"enable_prefix_caching": True},
                                   {"enable_prefix_caching": False, "chunked_prefill_size": 8}])
def test_greedy_tokens_and_logprobs_equal_without_speculation(tiny_model: Path, drafters: dict[str, Path],
                                                              reference: list[Any], algorithm: str, key: str | None,
                                                              setup: dict[str, Any]) -> None:
    llm = _overlapped(make_llm(tiny_model, **spec_kwargs(algorithm, drafters.get(key or "")), **setup, **OVERLAP))
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=1)
    for _ in range(2 if setup["enable_prefix_caching"] else 1):  # the second pass hits the prefix cache
        for o, ref in zip(generate(llm, params), reference):
            assert o.token_ids == ref.token_ids
            assert logprobs_of(o) == pytest.approx(logprobs_of(ref), abs=1e-4)
    _check_pool(llm)


@pytest.mark.parametrize("algorithm,key", [("NGRAM", None), ("STANDALONE", "draft"), ("EAGLE3", "eagle3")])
def test_seeded_and_penalised_sampling_is_unchanged(tiny_model: Path, drafters: dict[str, Path], algorithm: str,
                                                    key: str | None) -> None:
    _check_pool(_overlapped(seeded_and_penalised_unchanged(tiny_model, drafters, algorithm, key, **OVERLAP)))


def test_stop_tokens_and_max_tokens_inside_accepted_runs(tiny_model: Path, reference: list[Any]) -> None:
    """The target as its own draft model accepts every draft, so a stop token or the max_tokens end falls inside
    a verification, with the next step already planned: what follows is dropped, as in the synchronous loop."""
    refs = [r.token_ids for r in reference]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[refs[0][6]]),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[refs[2][9]]),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]
    base = generate(make_llm(tiny_model), params)
    llm = _overlapped(make_llm(tiny_model, **spec_kwargs("STANDALONE", tiny_model), **OVERLAP))
    outs = generate(llm, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert [o.finish_reason for o in outs] == [b.finish_reason for b in base]
    assert len(outs[1].token_ids) == 5 and len(outs[3].token_ids) == 7
    _check_pool(llm)


@pytest.mark.parametrize("algorithm,key", [("STANDALONE", "draft"), ("EAGLE3", "eagle3")])
def test_preemption_with_drafts_keeps_the_greedy_tokens(tiny_model: Path, drafters: dict[str, Path],
                                                        reference: list[Any], algorithm: str, key: str) -> None:
    drafter = tiny_model if algorithm == "STANDALONE" else drafters[key]
    llm = _overlapped(make_llm(tiny_model, max_total_tokens=64, max_model_len=48, enable_prefix_caching=False,
                               schedule_conservativeness=0.0, **spec_kwargs(algorithm, drafter), **OVERLAP))
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert llm.engine.stats().num_preemptions > 0
    _check_pool(llm)


# ---- MTP on the tiny DeepSeek-V3 ----------------------------------------------------------------------------

@pytest.mark.parametrize("steps", [1, 2])
def test_mtp_greedy_tokens_equal_without_speculation(tiny_v3: Path, mtp_reference: dict[str, Any],
                                                     steps: int) -> None:
    llm = _overlapped(make_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=steps,
                               chunked_prefill_size=8, **OVERLAP))
    params = SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True, logprobs=1)
    outs = generate(llm, params, MTP_PROMPTS)
    for p, o, lps in zip(MTP_PROMPTS, outs, mtp_reference["logprobs"]):
        assert o.token_ids == mtp_reference["tokens"][tuple(p)][: MTP_NEW]
        assert logprobs_of(o) == pytest.approx(lps, abs=1e-4)
    _check_pool(llm)


@pytest.mark.parametrize("steps,wrong", [(2, 4), (3, 10**9)])
def test_mtp_accepted_and_rejected_drafts_with_stops(tiny_v3: Path, mtp_reference: dict[str, Any],
                                                     monkeypatch: pytest.MonkeyPatch, steps: int, wrong: int) -> None:
    refs = mtp_reference["tokens"]
    oracle(monkeypatch, refs, wrong)
    llm = _overlapped(make_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=steps, **OVERLAP))
    want = [refs[tuple(p)] for p in MTP_PROMPTS]
    params = [SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True, stop_token_ids=[want[0][5]]),
              SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=MTP_NEW + 8, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True)]
    outs = generate(llm, params, MTP_PROMPTS)
    assert outs[0].token_ids == want[0][: want[0].index(want[0][5]) + 1]
    assert outs[1].token_ids == want[1][:4]
    assert outs[2].token_ids == want[2] and outs[3].token_ids == want[3][: MTP_NEW]
    assert llm.engine.stats().spec_num_accepted_tokens > 0
    _check_pool(llm)


def test_mtp_stop_string_inside_an_accepted_draft_run(tiny_v3_tok: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    case = stop_case(tiny_v3_tok)
    oracle(monkeypatch, {tuple(case.prompt): case.ref}, wrong=10**9)
    llm = _overlapped(LLM(model=str(tiny_v3_tok), dtype="float32", block_size=4, speculative_algorithm="MTP",
                          speculative_num_steps=3, **OVERLAP))
    seen = delta_lengths(monkeypatch, llm)
    got = llm.generate({"prompt_token_ids": case.prompt}, case.params)[0].outputs[0]
    assert got.token_ids == case.want.token_ids == case.ref[: case.keep] and got.text == case.want.text
    assert (got.finish_reason, got.stop_reason) == ("stop", case.stop)
    assert max(seen) > 1
    assert not llm.engine.has_work() and llm.engine.check_accounting().ok
