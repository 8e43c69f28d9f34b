"""Preemption by swap (engine/swap.py, preemption.py) with the FakeExecutor, whose simulated KV cache checks that
every position a request reads holds its own token: a tiny device pool preempts running requests, which are
swapped to host slots and resumed from them; outputs equal a run that never preempts; the swapped requests
prefill nothing twice; accounting over both tiers (swapped slots included) holds after every step, aborts of
swapped requests included; auto's choice follows the measured rates."""
from __future__ import annotations

from dataclasses import replace

import pytest
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

from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.swap import SwapCosts, SwapPolicy

BS = 4


def engine(num_blocks: int, host_blocks: int, mode: str = "recompute", overlap: bool = False,
           costs: SwapCosts | None = None) -> EngineCore:
    cfg = EngineConfig(num_blocks=num_blocks, block_size=BS, max_model_len=64, chunked_prefill_size=32,
                       num_host_blocks=host_blocks, preemption_mode=mode, swap_costs=costs)
    return EngineCore(cfg, FakeExecutor(num_blocks, BS, vocab_size=500), overlap=overlap)


def prompts() -> dict[str, list[int]]:
    return {f"r{i}": list(range(50 * i + 1, 50 * i + 19 + 3 * i)) for i in range(5)}


def run(core: EngineCore, reqs: dict[str, list[int]], abort: str | None = None) -> dict[str, list[int]]:
    for rid, p in reqs.items():
        core.add_request(rid, p, SamplingParams(max_tokens=24, ignore_eos=True))
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    steps = 0
    while core.has_work():
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
        steps += 1
        if abort is not None and steps == 12:
            core.abort(abort)
        rep = core.check_accounting()
        assert rep.ok, rep.problems
    return out


def prefilled_tokens(core: EngineCore) -> int:
    """Tokens the executor computed in multi-token chunks (prefills), over the whole run."""
    return sum(s.num_tokens for p in core.executor.plans for s in p.scheduled if s.num_tokens > 1)


@pytest.mark.parametrize("overlap", [False, True])
def test_swapped_and_resumed_requests_give_the_tokens_of_never_preempted_ones(overlap: bool) -> None:
    roomy = engine(200, 0)
    want = run(roomy, prompts())
    assert roomy.scheduler.num_preemptions == 0
    swapped, recomputed = engine(16, 64, "swap", overlap), engine(16, 64, "recompute", overlap)
    assert run(swapped, prompts()) == want
    assert run(recomputed, prompts()) == want
    host = swapped.scheduler.cache.host
    assert swapped.scheduler.num_preemptions > 0 and host.num_swapped_out > 0 and host.num_swapped_in > 0
    # a resumed request's computed tokens come back: far fewer tokens prefilled again than recompute's
    assert prefilled_tokens(swapped) < prefilled_tokens(recomputed)
    rep = swapped.check_accounting()
    assert rep.ok and rep.owned == 0 and not any(r.swap_slots for r in swapped.scheduler.requests.values())


def test_aborting_a_swapped_request_gives_its_slots_back() -> None:
    core = engine(16, 64, "swap")
    reqs = prompts()
    for rid, p in reqs.items():
        core.add_request(rid, p, SamplingParams(max_tokens=24, ignore_eos=True))
    while not any(r.swap_slots for r in core.scheduler.requests.values()):
        core.step()
        assert core.has_work()
    victim = next(r for r in core.scheduler.requests.values() if r.swap_slots)
    slots = list(victim.swap_slots)
    core.abort(victim.request_id)
    host = core.scheduler.cache.host
    assert not host._owned.intersection(slots) and core.check_accounting().ok
    while core.has_work():
        core.step()
        assert core.check_accounting().ok, core.check_accounting().problems
    assert core.check_accounting().owned == 0 and host.check([]) == []


def test_a_full_host_tier_falls_back_to_recompute() -> None:
    core = engine(16, 2, "swap")  # two slots: most preempted requests cannot be swapped
    want = run(engine(200, 0), prompts())
    assert run(core, prompts()) == want
    assert core.scheduler.num_preemptions > core.scheduler.cache.host.num_swapped_out // 2


def test_auto_swaps_where_the_measured_copy_is_cheaper() -> None:
    # copies of 1 MiB blocks at 10 GB/s (0.21 ms a block both ways) against 100k tokens/s (0.16 ms per block of
    # 16 tokens) plus attention's share, which grows with the context
    costs = SwapCosts(copy_gbps=10.0, prefill_tok_s=100_000.0, prefill_tokens=512, bytes_per_block=1 << 20,
                      context_s_per_token2=1e-7)
    policy = SwapPolicy("auto", costs)
    assert not policy.swaps(16, 1)  # short: 0.17 ms of prefill against 0.21 ms of copies
    assert costs.recompute_seconds(16) < costs.swap_seconds(1)
    assert policy.swaps(4096, 256)  # long: 0.88 s of prefill against 54 ms of copies
    assert not SwapPolicy("recompute", None).swaps(4096, 256) and SwapPolicy("swap", None).swaps(1, 1)
    with pytest.raises(ValueError, match="measured"):
        SwapPolicy("auto", None)
    assert SwapCosts.from_dict(costs.to_dict()) == costs
    even = costs.break_even_tokens(16)  # where the two costs cross: recompute below, swap above
    assert even is not None and 16 < even < 4096
    n = int(even // 16 + 1) * 16
    assert policy.swaps(n, n // 16) and not policy.swaps(n - 32, n // 16 - 2)


def test_auto_in_the_engine_matches_recompute_outputs() -> None:
    cheap_copies = SwapCosts(copy_gbps=100.0, prefill_tok_s=100.0, prefill_tokens=32, bytes_per_block=1024)
    core = engine(16, 64, "auto", costs=cheap_copies)
    assert run(core, prompts()) == run(engine(200, 0), prompts())
    assert core.scheduler.cache.host.num_swapped_out > 0
    dear_copies = SwapCosts(copy_gbps=1e-6, prefill_tok_s=1e9, prefill_tokens=32, bytes_per_block=1 << 20)
    never = engine(16, 64, "auto", costs=dear_copies)
    run(never, prompts())
    assert never.scheduler.num_preemptions > 0 and never.scheduler.cache.host.num_swapped_out == 0


def test_swap_needs_the_host_tier() -> None:
    with pytest.raises(ValueError, match="host tier"):
        engine(16, 0, "swap")
    from appliance.config import build_config
    from appliance.config.support import check_supported

    assert any(m.startswith("scheduler.preemption_mode: swap and auto keep")
               for m in check_supported(build_config(dotlist=["scheduler.preemption_mode=swap"])))
    assert check_supported(build_config(dotlist=["scheduler.preemption_mode=swap", "cache.host_cache=true"])) == []


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=ops_st(PREFIXES), host=st.sampled_from([1, 3, 8, 32]), disk=st.sampled_from([0, 2, 16]),
       mode=st.sampled_from(["swap", "recompute"]), overlap=st.booleans())
def test_random_workloads_over_three_tiers_never_leak_and_keep_outputs(cfg: dict, ops: list, host: int, disk: int,
                                                                       mode: str, overlap: bool) -> None:
    # the property test's arrivals, aborts and tiny pools, with host and disk tiers and swapped preemptions:
    # accounting over every tier after each op and step, each request's output as it generates alone
    cfg["enable_prefix_caching"] = True
    config = replace(engine_config(cfg), num_host_blocks=host, num_disk_blocks=disk, preemption_mode=mode)
    ex = FakeExecutor(config.num_blocks, config.block_size, vocab_size=48)
    core = EngineCore(config, ex, overlap=overlap)
    run_ = drive(core, ops, PREFIXES)
    rep = core.check_accounting()
    assert rep.ok and rep.owned == 0, rep.problems
    assert_each_generates_what_it_generates_alone(ex, run_)
