"""Property tests (hypothesis) on scheduler + block pool + prefix cache through EngineCore.

Random arrivals (with shared prefixes), aborts, eos finishes and tiny pools that force preemption: after every
operation each block is owned exactly as often as live request tables hold it, the FakeExecutor sees a
consistent delta stream and a consistent simulated KV cache, the pool is whole again when all requests end,
and every request that was not aborted generated exactly what it generates alone.
"""
from __future__ import annotations

from engine_workload import (
    PREFIXES,
    assert_each_generates_what_it_generates_alone,
    config_st,
    drive,
    engine_config,
    ops_st,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine import EngineCore, IllegalTransition, SamplingParams
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.request import LEGAL_TRANSITIONS, Request, RequestStatus


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=ops_st(PREFIXES))
def test_random_workloads_never_leak_or_double_own_blocks(cfg: dict, ops: list) -> None:
    config = engine_config(cfg)
    ex = FakeExecutor(config.num_blocks, config.block_size, vocab_size=48)  # small vocab: eos comes up now and then
    core = EngineCore(config, ex)
    run = drive(core, ops, PREFIXES)

    stats = core.stats()
    assert stats.blocks_owned == 0 and stats.blocks_free + stats.blocks_cached == config.num_blocks
    if not config.enable_prefix_caching:
        assert stats.blocks_cached == 0
    assert_each_generates_what_it_generates_alone(ex, run)


@settings(max_examples=200, deadline=None)
@given(walk=st.lists(st.sampled_from(list(RequestStatus)), max_size=12))
def test_random_walks_follow_the_transition_table(walk: list[RequestStatus]) -> None:
    req = Request("r", [1, 2], SamplingParams(), 0.0)
    for dst in walk:
        src = req.status
        if dst in LEGAL_TRANSITIONS[src]:
            req.transition(dst)
            assert req.status is dst
        else:
            try:
                req.transition(dst)
            except IllegalTransition:
                assert req.status is src
            else:
                raise AssertionError(f"{src} -> {dst} was accepted")
