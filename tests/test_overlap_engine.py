"""Overlap scheduling (EngineCore(overlap=True)) on the FakeExecutor: one step always in flight.

engine_workload.LazyFakeExecutor runs each step lazily, when its result is collected, in submission order: like a device
stream, nothing of step N is visible to the host before collect, and plan N+1 is validated against the worker
state after step N ran. Random arrivals, aborts, EOS finishes and tiny pools (preemption): no block leaks or is
owned twice, no delta follows a finish, and every request that was not aborted generates exactly what it
generates alone (and what the synchronous loop gives it), max_tokens included.
"""
from __future__ import annotations

from engine_workload import (
    EOS,
    PREFIXES,
    LazyFakeExecutor,
    assert_each_generates_what_it_generates_alone,
    config_st,
    drive,
    engine_config,
    ops_st,
)
from hypothesis import HealthCheck, given, settings

from appliance.engine import EngineConfig, EngineCore, SamplingParams
from appliance.engine.fake_executor import reference_generation

OVERLAP_PREFIXES = PREFIXES[:3]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=ops_st(OVERLAP_PREFIXES))
def test_overlap_matches_reference_and_never_leaks(cfg: dict, ops: list) -> None:
    config = engine_config(cfg)
    ex = LazyFakeExecutor(config.num_blocks, config.block_size, vocab_size=48)  # small vocab: eos now and then
    core = EngineCore(config, ex, overlap=True)
    run = drive(core, ops, OVERLAP_PREFIXES)

    stats = core.stats()
    assert stats.blocks_owned == 0 and stats.blocks_free + stats.blocks_cached == config.num_blocks
    assert core.scheduler.num_in_flight == 0 and not ex.queue
    assert_each_generates_what_it_generates_alone(ex, run)


def test_overlap_submits_the_next_step_before_collecting_the_previous() -> None:
    config = EngineConfig(num_blocks=64, block_size=4, max_model_len=64)
    ex = LazyFakeExecutor(64, 4)
    core = EngineCore(config, ex, overlap=True)
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    outputs: list[int] = []
    while core.has_work():
        for d in core.step():
            outputs.extend(d.new_token_ids)
    want, _ = reference_generation(ex.next_token, [5, 6, 7], 4, 64)
    assert outputs == want
    # prefill (0) and three decodes (1..3); each collect comes after the next step's submit, except the last
    assert ex.calls == [("submit", 0), ("submit", 1), ("collect", 0), ("submit", 2), ("collect", 1),
                        ("submit", 3), ("collect", 2), ("collect", 3)]
    assert core.stats().num_steps == 4 and core.check_accounting().ok


def test_overlap_drops_the_step_after_an_eos_and_frees_its_block() -> None:
    # the model answers EOS at once: step 1 (planned before step 0's EOS was seen) computes a wasted decode
    config = EngineConfig(num_blocks=16, block_size=4, max_model_len=32, eos_token_ids={EOS},
                          enable_prefix_caching=False)
    ex = LazyFakeExecutor(16, 4, next_token=lambda h: EOS if len(h) >= 5 else 9)
    core = EngineCore(config, ex, overlap=True)
    core.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=8))
    deltas = []
    while core.has_work():
        deltas.extend(core.step())
    assert [(d.new_token_ids, d.finish_reason) for d in deltas] == [((9,), None), ((EOS,), "stop")]
    assert len(ex.plans) == 3  # prefill, the decode that samples EOS, one wasted decode
    assert core.stats().blocks_free == 16
    core.add_request("b", [1], SamplingParams(max_tokens=1))
    while core.has_work():
        core.step()
    assert ex.plans[-1].finished_ids == ["a"]  # the worker is told to forget it with the next plan


def test_overlap_never_schedules_past_max_tokens() -> None:
    config = EngineConfig(num_blocks=16, block_size=4, max_model_len=32)
    ex = LazyFakeExecutor(16, 4)
    core = EngineCore(config, ex, overlap=True)
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    n = 0
    while core.has_work():
        n += sum(len(d.new_token_ids) for d in core.step())
    assert n == 3 and len(ex.plans) == 3  # known length ends are not computed one step too far
