"""Overlap scheduling with speculative decoding (EngineCore(overlap=True), num_speculative_tokens = k) on the
FakeExecutor playing an MTP worker that runs each step lazily, when it is collected: step N+1 is planned before
N's accepted count is known, as 1 + d tokens with blocks for every draft of N accepted, and the worker verifies
the drafts it holds. Every request still generates exactly what it generates alone (stops mid-chunk, max_tokens
and max_model_len exact), blocks stay accounted for through aborts and preemption, and the counters count the
drafts the worker verified."""
from __future__ import annotations

import pytest
from engine_workload import (
    EOS,
    MAX_MODEL_LEN,
    PREFIXES,
    LazyFakeExecutor,
    assert_each_generates_what_it_generates_alone,
    config_st,
    drive,
    engine_config,
    ops_st,
    spec_engine,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine import EngineConfig, EngineCore, SamplingParams
from appliance.engine.fake_executor import reference_generation


def _run(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while core.has_work():
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=ops_st(PREFIXES), k=st.integers(1, 3), seed=st.integers(0, 1000))
def test_random_workloads_generate_what_they_generate_alone(cfg: dict, ops: list, k: int, seed: int) -> None:
    config = engine_config({**cfg, "num_speculative_tokens": k})
    ex = LazyFakeExecutor(config.num_blocks, config.block_size, vocab_size=48, num_speculative_tokens=k,
                          max_model_len=MAX_MODEL_LEN, overlap=True,
                          draft_quality=lambda rid, n: (n * seed + len(rid)) % (k + 1),
                          draft_count=lambda rid, n: (n + seed) % (k + 1))  # 0..k: plans ask for more
    core = EngineCore(config, ex, overlap=True)
    run = drive(core, ops, PREFIXES)
    stats = core.stats()
    assert stats.blocks_owned == 0 and stats.blocks_free + stats.blocks_cached == config.num_blocks
    assert core.scheduler.num_in_flight == 0 and not ex.queue
    assert stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens <= k * stats.spec_num_drafts
    assert_each_generates_what_it_generates_alone(ex, run)


@pytest.mark.parametrize("k", [1, 3])
def test_verifications_overlap_and_match_the_synchronous_loop(k: int) -> None:
    prompts = {f"r{i}": [20 + i, 21, 22, 23, 24][: 2 + i] for i in range(3)}
    params = SamplingParams(max_tokens=13, ignore_eos=True)
    outputs, counters = [], []
    for overlap in (False, True):
        config = EngineConfig(num_blocks=64, block_size=4, max_model_len=MAX_MODEL_LEN, eos_token_ids={EOS},
                              num_speculative_tokens=k)
        ex = LazyFakeExecutor(64, 4, vocab_size=48, num_speculative_tokens=k, max_model_len=MAX_MODEL_LEN,
                              draft_quality=lambda rid, n: n % (k + 1), overlap=overlap)
        core = EngineCore(config, ex, overlap=overlap)
        for rid, p in prompts.items():
            core.add_request(rid, p, params)
        outputs.append(_run(core))
        stats = core.stats()
        counters.append((stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens))
        assert core.check_accounting().ok and stats.blocks_owned == 0
        if overlap:  # steps that verify drafts were submitted before the previous step was collected
            verify_steps = [p.step_id for p in ex.plans if any(s.num_tokens > 1 for s in p.scheduled)
                            and not p.new_requests]
            assert verify_steps
            calls = ex.calls
            for step in verify_steps:
                assert calls.index(("submit", step)) < calls.index(("collect", step - 1))
    for rid, p in prompts.items():
        want, _ = reference_generation(LazyFakeExecutor(1, 4, vocab_size=48).next_token, p, 13, MAX_MODEL_LEN,
                                       frozenset({EOS}), ignore_eos=True)
        assert outputs[0][rid] == outputs[1][rid] == want
    assert all(c[0] > 0 and c[2] > 0 for c in counters)


def test_a_plan_asking_for_more_drafts_than_held_verifies_those_held() -> None:
    # the worker holds 1 or 0 drafts (a short n-gram match, none); the plans, made while the step that drafts
    # runs, ask for k, and the worker verifies what it holds: outputs, rewinds and counters follow that
    k = 3
    core, ex = spec_engine(k, quality=lambda rid, n: k, count=lambda rid, n: 1 if n % 3 else 0, overlap=True)
    results = []
    run = ex.execute
    ex.execute = lambda plan: results.append(run(plan)) or results[-1]
    core.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=12, ignore_eos=True))
    got = _run(core)["a"]
    want, _ = reference_generation(ex.next_token, [5, 6, 7, 8, 9], 12, MAX_MODEL_LEN, frozenset({EOS}),
                                   ignore_eos=True)
    assert got == want
    clamped = [v for r in results for v in r.verified.values()]
    assert 0 in clamped and 1 in clamped  # both a plain sample and a one-draft verification in place of k
    stats = core.stats()
    assert stats.spec_num_draft_tokens == stats.spec_num_drafts == stats.spec_num_accepted_tokens > 0
    assert core.check_accounting().ok and stats.blocks_owned == 0


def test_a_stop_mid_chunk_drops_the_step_in_flight() -> None:
    k = 2
    core, ex = spec_engine(k, quality=lambda rid, n: k, enable_prefix_caching=False, overlap=True)
    ref, _ = reference_generation(ex.next_token, [3, 4, 5], 12, MAX_MODEL_LEN, frozenset({EOS}), ignore_eos=True)
    stop = ref[4]
    core.add_request("a", [3, 4, 5], SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop]))
    got = _run(core)["a"]
    assert got == ref[: ref.index(stop) + 1]
    assert core.stats().blocks_free == 64


def test_models_with_recurrent_state_are_refused() -> None:
    config = EngineConfig(num_blocks=64, max_model_len=32, num_speculative_tokens=1, num_state_slots=4)
    with pytest.raises(ValueError, match="recurrent-state layers; turn scheduler.enable_overlap off"):
        EngineCore(config, LazyFakeExecutor(64, 16), overlap=True)
