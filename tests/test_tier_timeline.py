"""A host-tier hit's step timeline (engine/host_tier.py, engine/prefix_cache.py) with the FakeExecutor, whose
simulated KV cache checks every position a request reads: a turn whose history the device evicted gets its first
token in as many steps as a device hit, its loads travel in its admission plan beside those of the other turns
admitted with it; under write-through (cache.host_cache_write_policy) the blocks are copied to the host in steps
that load nothing, so the admission step that evicts them carries loads only."""
from __future__ import annotations

from dataclasses import replace

import pytest
from engine_workload import (
    PREFIXES,
    LazyFakeExecutor,
    assert_each_generates_what_it_generates_alone,
    config_st,
    drive,
    engine_config,
    ops_st,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.config import build_config
from appliance.config.support import check_supported
from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.host_tier import LOAD, STORE, WRITE_THROUGH_BLOCKS
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.step import StepPlan

BS = 4
SESSIONS = 3
POOL = 40  # blocks: the three second turns run at once, a flood of 150 tokens evicts their histories


def engine(num_blocks: int, host_blocks: int, policy: str = "write_back", max_model_len: int = 160,
           chunk: int = 64) -> EngineCore:
    cfg = EngineConfig(num_blocks=num_blocks, block_size=BS, max_model_len=max_model_len, chunked_prefill_size=chunk,
                       num_host_blocks=host_blocks, host_cache_write_policy=policy)
    return EngineCore(cfg, FakeExecutor(num_blocks, BS, vocab_size=500))


def run(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int = 6) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Run the requests to the end, accounting checked every step; (outputs, each request's steps from its
    arrival to its first token, the step that samples it included)."""
    for rid, p in prompts.items():
        core.add_request(rid, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    first: dict[str, int] = {}
    steps = 0
    while core.has_work():
        steps += 1
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
            first.setdefault(d.request_id, steps)
        assert core.check_accounting().ok, core.check_accounting().problems
    return out, first


def turns(core: EngineCore, flood: bool) -> tuple[dict[str, list[int]], dict[str, int], list[StepPlan]]:
    """Three sessions' first turns, optionally a flood of distinct tokens that takes most of the device pool (their
    blocks are evicted), then their second turns at once: the history, its answer and a tool result. Returns the
    second turns' outputs, steps to first token and the plans they ran in."""
    first = {f"s{i}": list(range(100 * i + 1, 100 * i + 33)) for i in range(SESSIONS)}
    answers, _ = run(core, first)
    if flood:
        run(core, {"flood": list(range(2000, 2150))})
    second = {f"{rid}-2": p + answers[rid] + [900 + i for i in range(5)] for rid, p in first.items()}
    start = len(core.executor.plans)
    out, steps = run(core, second)
    return out, steps, core.executor.plans[start:]


def test_a_host_hit_gets_its_first_token_in_as_many_steps_as_a_device_hit() -> None:
    tiered = engine(POOL, 96)
    out, steps, plans = turns(tiered, flood=True)
    device = engine(200, 0)
    want, device_steps, _ = turns(device, flood=False)
    assert out == want
    loaded = {c[1] for c in plans[0].host_copies if c[0] == LOAD}
    assert loaded, "the second turns' histories come back from the host"
    assert steps == device_steps == {rid: 1 for rid in out}  # sampled in the admission step, as a device hit
    # every turn was admitted in that first plan and its loads travel there, none later
    assert {nr.request_id for nr in plans[0].new_requests} == set(out)
    assert all(set(nr.block_ids) & loaded for nr in plans[0].new_requests)
    assert not any(c[0] == LOAD for p in plans[1:] for c in p.host_copies)
    assert tiered.scheduler.cache.hit_tokens > device.scheduler.cache.hit_tokens - SESSIONS * BS


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_write_through_takes_the_stores_out_of_the_admission_step(policy: str) -> None:
    core = engine(POOL, 96, policy)
    out, steps, plans = turns(core, flood=True)
    _, want_steps, _ = turns(engine(200, 0), flood=False)
    assert out == turns(engine(POOL, 0), flood=True)[0] and steps == want_steps
    admission = plans[0].host_copies
    assert any(c[0] == LOAD for c in admission) and plans[0].host_writes == 0
    stores = sum(1 for c in admission if c[0] == STORE)
    if policy == "write_back":
        assert stores > 0  # the blocks its loads land in are evicted here, and copied out first
    else:
        assert stores == 0  # written through in the earlier steps, which loaded nothing
        assert core.scheduler.cache.host.num_stored > 0
    host = core.scheduler.cache.host
    assert host is not None and host.num_loaded > 0


def test_write_through_rides_on_steps_that_load_nothing_a_capped_number_a_step() -> None:
    n = WRITE_THROUGH_BLOCKS + 8
    core = engine(n + 40, 2 * n + 80, "write_through", max_model_len=(n + 2) * BS, chunk=1024)
    cache = core.scheduler.cache
    core.add_request("long", list(range(1, n * BS + 2)), SamplingParams(max_tokens=4, ignore_eos=True))
    core.step()  # the whole prompt in one step: n full blocks cached, queued for the next plans
    assert cache.num_unwritten == n
    while core.has_work():
        core.step()
    stores = [sum(1 for c in p.host_copies if c[0] == STORE) for p in core.executor.plans]
    assert stores[:3] == [0, WRITE_THROUGH_BLOCKS, n - WRITE_THROUGH_BLOCKS]
    # all of them the write-through's, which the step's forward does not wait for
    assert [p.host_writes for p in core.executor.plans] == stores
    # the block its answer filled was cached by the last step: it waits for a plan (or its eviction copies it)
    assert sum(stores) == n and cache.num_unwritten == 1 and cache.host.num_stored == n
    # a step that loads holds them back: its first tokens wait for its copies
    core.add_request("more", list(range(5000, 5000 + 8 * BS + 1)), SamplingParams(max_tokens=1))
    core.step()
    held = cache.num_unwritten
    assert held == 8
    cache.host.copies.append((LOAD, 0, 0))  # as an admission's host hit queues it
    assert cache.host.loading() and core.scheduler._host_copies() == ([(LOAD, 0, 0)], 0)
    assert cache.num_unwritten == held
    copies, writes = core.scheduler._host_copies()
    assert writes == held == sum(1 for c in copies if c[0] == STORE) and cache.num_unwritten == 0


def test_a_write_through_queue_skips_blocks_evicted_or_reset_before_their_turn() -> None:
    core = engine(POOL, 96, "write_through")
    cache, host = core.scheduler.cache, core.scheduler.cache.host
    run(core, {"a": list(range(1, 33))}, max_tokens=3)  # 8 full blocks, written through by its decode steps
    assert cache.num_unwritten == 0 and host.num_stored == 8
    run(core, {"b": list(range(200, 232))}, max_tokens=1)  # 8 more, cached by its last step: still queued
    assert cache.num_unwritten == 8
    start = len(core.executor.plans)
    run(core, {"flood": list(range(2000, 2150))}, max_tokens=1)  # evicts a's and b's blocks
    evicting = core.executor.plans[start].host_copies
    # b's blocks are copied by their eviction, a's (on the host already) not at all, none twice
    assert sum(1 for c in evicting if c[0] == STORE) == 8
    assert host.num_stored == 16 + 150 // BS - cache.num_unwritten  # and the flood's own, written through
    assert len({c[2] for c in evicting}) == len(evicting)
    assert core.check_accounting().ok
    run(core, {"c": list(range(300, 332))}, max_tokens=1)
    queued = cache.num_unwritten
    assert queued >= 8
    cache.reset()  # dropped with the cache: nothing is written for them
    assert cache.num_unwritten == 0 and cache.write_through(WRITE_THROUGH_BLOCKS) == 0 and not host.copies


def test_write_policy_is_checked_from_config_to_engine() -> None:
    with pytest.raises(ValueError, match="host_cache_write_policy"):
        EngineConfig(num_blocks=8, block_size=BS, max_model_len=32, num_host_blocks=8,
                     host_cache_write_policy="write_through_selective")
    on = ["cache.host_cache=true"]
    ok = build_config(dotlist=[*on, "cache.host_cache_write_policy=write_through"])
    assert not [m for m in check_supported(ok) if "host tier" in m]
    assert EngineConfig.from_appliance(ok, 64, [0], 32).host_cache_write_policy == "write_through"
    assert EngineConfig.from_appliance(build_config(dotlist=on), 64, [0], 32).host_cache_write_policy == "write_back"
    refused = build_config(dotlist=[*on, "cache.host_cache_write_policy=write_through_selective"])
    assert any("write_through_selective" in m for m in check_supported(refused))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=ops_st(PREFIXES), host=st.integers(1, 24), policy=st.sampled_from(["write_back",
                                                                                            "write_through"]),
       overlap=st.booleans())
def test_random_workloads_over_a_host_tier_under_either_write_policy(cfg: dict, ops: list, host: int, policy: str,
                                                                     overlap: bool) -> None:
    """Random arrivals, aborts and tiny pools over a host tier of a few slots (recycled, pinned by admissions):
    accounting over both tiers holds after every op, the simulated KV read through every load is the request's own,
    and each request generates what it generates alone, overlapped (steps run when collected) or not."""
    cfg["enable_prefix_caching"] = True
    config = replace(engine_config(cfg), num_host_blocks=host, host_cache_write_policy=policy)
    ex = (LazyFakeExecutor if overlap else FakeExecutor)(config.num_blocks, config.block_size, vocab_size=48,
                                                         overlap=overlap)
    core = EngineCore(config, ex, overlap=overlap)
    run = drive(core, ops, PREFIXES)
    assert_each_generates_what_it_generates_alone(ex, run)
    assert core.scheduler.cache.host.check([]) == []
