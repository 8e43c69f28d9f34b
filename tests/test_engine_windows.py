"""EngineCore with sliding-window KV cache groups (engine/window_blocks.py) against the FakeExecutor, which keeps
each group's KV slots and checks every key a query reads in its window: outputs equal each request run alone
under chunked prefill, prefix hits, preemption and the overlap loop; every block is accounted for after each
step; a request's blocks in a sliding group stay within the window's bound; tiny pools preempt."""
from __future__ import annotations

import dataclasses
import random

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

from appliance.engine import EngineConfig, EngineCore, RequestDelta, SamplingParams
from appliance.engine.fake_executor import FakeExecutor, reference_generation
from appliance.engine.kv_groups import KVGroup, max_blocks_held

EOS = 0
BS = 4
MAX_LEN = 96


def make_core(windows: tuple[int, ...], window_blocks: tuple[int, ...], overlap: bool = False,
              **cfg) -> tuple[EngineCore, FakeExecutor]:
    cfg.setdefault("num_blocks", 96)
    config = EngineConfig(block_size=BS, max_model_len=MAX_LEN, eos_token_ids={EOS}, window_sizes=windows,
                          window_blocks=window_blocks, **cfg)
    ex = FakeExecutor(config.num_blocks, BS, vocab_size=50, window_sizes=windows, window_blocks=window_blocks)
    return EngineCore(config, ex, overlap=overlap), ex


def run_all(core: EngineCore, ps: dict[str, list[int]], params: SamplingParams,
            suffix: str = "") -> dict[str, list[int]]:
    """Every prompt added (its id + suffix), then the engine drained."""
    for rid, p in ps.items():
        core.add_request(rid + suffix, p, params)
    return drain(core)


def drain(core: EngineCore) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    windows = core.scheduler.windows
    assert windows is not None
    for _ in range(20_000):
        if not core.has_work():
            return out
        deltas: list[RequestDelta] = core.step()
        for d in deltas:
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        rep = core.check_accounting()
        assert rep.ok, rep.problems
        for req in core.scheduler.running:
            held = windows.held(req)
            if req.num_computed_tokens >= req.num_prompt_tokens:  # decoding: at most the window's blocks
                assert all(h <= max_blocks_held(g.window, BS)
                           for h, g in zip(held, windows.groups)), (req.request_id, held)
    raise AssertionError("engine did not finish")


def prompts(seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 50) for _ in range(40)]
    out = {"long": [rng.randrange(1, 50) for _ in range(70)], "short": [3, 4, 5]}
    for i in range(6):  # shared prefixes of several lengths: hits whose window is, or is not, still cached
        out[f"shared{i}"] = shared[: 8 + 6 * i] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 9))]
    return out


CASES = {
    "chunk8": dict(chunked_prefill_size=8),
    "chunk16-two-windows": dict(chunked_prefill_size=16, windows=(5, 12)),
    "no-chunking": dict(chunked_prefill_size=-1, max_prefill_tokens=32),
    "no-prefix-cache": dict(chunked_prefill_size=8, enable_prefix_caching=False),
    "small-window-pool-preempts": dict(chunked_prefill_size=8, window_pool=16),
    "small-full-pool-preempts": dict(chunked_prefill_size=8, num_blocks=30),
    "overlap": dict(chunked_prefill_size=8, overlap=True),
    # window_pool 0: the sliding groups draw from the full group's pool (one memory: a block in two tables at once
    # shows in the FakeExecutor as lost KV)
    "shared-pool": dict(chunked_prefill_size=8, window_pool=0, num_blocks=160),
    "shared-pool-two-windows": dict(chunked_prefill_size=16, windows=(5, 12), window_pool=0, num_blocks=200),
    "shared-pool-overlap": dict(chunked_prefill_size=8, window_pool=0, num_blocks=160, overlap=True),
    "shared-pool-preempts": dict(chunked_prefill_size=8, window_pool=0, num_blocks=48),
}


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_equal_each_request_run_alone(name: str) -> None:
    cfg = dict(CASES[name])
    windows = cfg.pop("windows", (6,))
    pool = cfg.pop("window_pool", 64)
    core, ex = make_core(windows, (pool,) * len(windows), **cfg)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ps = prompts(1)
    out = run_all(core, ps, params)
    # a second wave of the same prompts: prefix hits against what the first left cached
    out.update(run_all(core, ps, params, suffix="-again"))
    for rid, p in ps.items():
        want, _ = reference_generation(ex.next_token, p, 40, MAX_LEN, frozenset({EOS}), ignore_eos=True)
        assert out[rid] == want and out[rid + "-again"] == want, rid
    stats = core.stats()
    assert stats.blocks_owned == 0 and stats.blocks_free + stats.blocks_cached == stats.blocks_total
    if core.config.window_shared:  # one pool, its block 0 the groups' null block
        assert stats.blocks_total == core.config.num_blocks - 1
    else:
        assert stats.blocks_total == core.config.num_blocks + sum(n - 1 for n in core.config.window_blocks)
    if "preempts" in name:
        assert stats.num_preemptions > 0
    if name != "no-prefix-cache":
        assert stats.prefix_hit_tokens > 0


@pytest.mark.parametrize("chunk", [8, 16])
@pytest.mark.parametrize("overlap", [False, True])
def test_a_long_sequence_holds_only_its_window_in_the_sliding_pool(overlap: bool, chunk: int) -> None:
    """One request of 90 tokens in a sliding pool of exactly its peak (the window and a chunk) and the null
    block: the full pool holds the context, the sliding pool never more than the window, so it never preempts
    itself; in overlap mode too, where a step is planned before the previous one's update."""
    window = 6
    need = KVGroup(window, ()).blocks_held(MAX_LEN, BS, chunk)
    core, ex = make_core((window,), (need + 1,), overlap=overlap, chunked_prefill_size=chunk,
                         enable_prefix_caching=False)
    prompt = list(range(1, 31))
    core.add_request("r", prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    out = drain(core)
    want, _ = reference_generation(ex.next_token, prompt, 60, MAX_LEN, frozenset({EOS}), ignore_eos=True)
    assert out["r"] == want and core.stats().num_preemptions == 0


def test_config_refuses_what_the_groups_cannot_do_yet() -> None:
    base = dict(num_blocks=64, block_size=BS, max_model_len=MAX_LEN, window_sizes=(8,), window_blocks=(64,))
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig(**base, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="host KV tier"):
        EngineConfig(**base, num_host_blocks=8)
    with pytest.raises(ValueError, match="same groups"):
        EngineConfig(**{**base, "window_blocks": (64, 64)})
    with pytest.raises(ValueError, match="holds up to"):
        EngineConfig(**{**base, "window_blocks": (3,)})
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(**{**base, "window_sizes": (0,)})
    with pytest.raises(ValueError, match="either every sliding group shares"):
        EngineConfig(**{**base, "window_sizes": (8, 4), "window_blocks": (0, 64)})
    # shared: one sequence of 96 tokens holds 24 full blocks and, prefilled whole, 24 of the window's, beside the
    # null block
    EngineConfig(**{**base, "window_blocks": (0,), "num_blocks": 49})
    with pytest.raises(ValueError, match="share has 47 blocks"):
        EngineConfig(**{**base, "window_blocks": (0,), "num_blocks": 48})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=ops_st(PREFIXES), window=st.integers(1, 10), extra=st.sampled_from([0, 0, 1, 3, 8]),
       overlap=st.booleans(), shared=st.booleans(), conservativeness=st.sampled_from([0.0, 1.0]))
def test_random_workloads_with_a_window_group(cfg: dict, ops: list, window: int, extra: int, overlap: bool,
                                              shared: bool, conservativeness: float) -> None:
    """The engine's property workloads (arrivals with shared prefixes, aborts, eos, tiny pools that preempt) with
    a sliding group of a random window whose pool holds from one sequence's peak upwards, its own or the full
    group's (shared), with and without the output reservation: accounting after every op, every key a window reads checked by the FakeExecutor, outputs as
    each request alone."""
    config = dataclasses.replace(engine_config(cfg), schedule_conservativeness=conservativeness)
    need = KVGroup(window, ()).blocks_held(config.max_model_len, config.block_size, config.step_tokens.largest_chunk)
    if shared:  # one pool that holds one sequence's peak in both groups, and the null block
        full = -(-config.max_model_len // config.block_size)
        config = dataclasses.replace(config, window_sizes=(window,), window_blocks=(0,),
                                     num_blocks=max(config.num_blocks, full + need + 1 + extra))
    else:
        config = dataclasses.replace(config, window_sizes=(window,), window_blocks=(need + 1 + extra,))
    ex = FakeExecutor(config.num_blocks, config.block_size, vocab_size=48, window_sizes=config.window_sizes,
                      window_blocks=config.window_blocks)
    core = EngineCore(config, ex, overlap=overlap)
    run = drive(core, ops, PREFIXES)
    stats = core.stats()
    assert stats.blocks_owned == 0 and stats.blocks_free + stats.blocks_cached == stats.blocks_total
    assert_each_generates_what_it_generates_alone(ex, run)


@pytest.mark.parametrize("num_blocks", [60, 80])
def test_shared_pool_admission_leaves_room_for_the_sliding_tables_growth(num_blocks: int) -> None:
    """With the output reservation on (schedule_conservativeness 1, ignore_eos outputs reserved whole), a shared
    pool also keeps room for the sliding tables' growth up to their window (WindowBlocks.room): three groups of
    a 6-token window beside the full one, prompts shorter and longer than the window, and no request is
    preempted (without that room, these pools preempt 5 and 1 times)."""
    core, ex = make_core((6, 6, 6), (0, 0, 0), chunked_prefill_size=8, num_blocks=num_blocks,
                         schedule_conservativeness=1.0)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ps = prompts(1)
    out = run_all(core, ps, params)
    for rid, p in ps.items():
        want, _ = reference_generation(ex.next_token, p, 40, MAX_LEN, frozenset({EOS}), ignore_eos=True)
        assert out[rid] == want, rid
    assert core.stats().num_preemptions == 0
