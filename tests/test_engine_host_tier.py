"""The host KV tier in the engine (engine/host_tier.py) with the FakeExecutor, whose simulated KV cache checks that
every position a request reads holds its own token: blocks evicted from a tiny device pool are copied to host
slots and copied back on a later hit; outputs equal a run without any cache; accounting over both tiers holds
after aborts and preemption; KV events name the host medium."""
from __future__ import annotations

from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.host_tier import LOAD, STORE, HostTier
from appliance.engine.sampling_params import SamplingParams
from appliance.executor.block_copies import HostRun, host_runs

BS = 4


def engine(num_blocks: int, host_blocks: int, events: list | None = None, caching: bool = True,
           disk_blocks: int = 0) -> EngineCore:
    cfg = EngineConfig(num_blocks=num_blocks, block_size=BS, max_model_len=64, chunked_prefill_size=32,
                       num_host_blocks=host_blocks, enable_prefix_caching=caching, num_disk_blocks=disk_blocks)
    sink = None if events is None else (lambda *a, **kw: events.append((a[0], a[1], kw.get("medium"))))
    return EngineCore(cfg, FakeExecutor(num_blocks, BS, vocab_size=500), on_kv_event=sink)


def run(core: EngineCore, prompts: dict[str, list[int]], max_tokens: int = 6) -> dict[str, list[int]]:
    for rid, p in prompts.items():
        core.add_request(rid, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    while core.has_work():
        for d in core.step():
            out[d.request_id].extend(d.new_token_ids)
        assert core.check_accounting().ok, core.check_accounting().problems
    return out


def more_hits_than(tiered: EngineCore, fewer: EngineCore) -> None:
    """Over four turns of sessions on a 24-block pool, tiered answers as an engine without any cache does and hits
    more than `fewer` (the same pool with fewer tiers) on the same turns."""
    cold = engine(24, 0, caching=False)
    for turn in sessions(4):
        assert run(tiered, turn) == run(cold, turn)
        run(fewer, turn)
    assert tiered.scheduler.cache.hit_tokens > fewer.scheduler.cache.hit_tokens


def run_with_aborts(core: EngineCore, turns: list[dict[str, list[int]]]) -> None:
    """Each turn's requests decode 20 tokens; after 3 steps the turn's first one is aborted, the rest run to the
    end with the accounting checked after every step."""
    for turn in turns:
        for rid, p in turn.items():
            core.add_request(rid, p, SamplingParams(max_tokens=20, ignore_eos=True))
        for _ in range(3):
            core.step()
        core.abort(next(iter(turn)))
        while core.has_work():
            core.step()
            assert core.check_accounting().ok, core.check_accounting().problems


def sessions(turns: int) -> list[dict[str, list[int]]]:
    """Per turn three sessions whose prompts grow (each starts with the last), then a flood of distinct tokens
    that needs most of the device pool, so the sessions' blocks are evicted between turns."""
    base = {f"s{i}": list(range(100 * i + 1, 100 * i + 21)) for i in range(3)}
    out: list[dict[str, list[int]]] = []
    for t in range(turns):
        out.append({f"{rid}-t{t}": p + list(range(900 + t * 10, 900 + t * 10 + 4 * t)) for rid, p in base.items()})
        out.append({f"flood{t}": list(range(2000 + 100 * t, 2000 + 100 * t + 56))})
    return out


def test_evicted_blocks_come_back_from_the_host_with_the_same_outputs() -> None:
    events: list = []
    tiered = engine(24, 64, events)
    more_hits_than(tiered, engine(24, 0))  # the loads made hits the device alone could not
    host = tiered.scheduler.cache.host
    assert host is not None and host.num_stored > 0 and host.num_loaded > 0
    copies = [c for p in tiered.executor.plans for c in p.host_copies]
    assert {c[0] for c in copies} == {STORE, LOAD}
    assert any(m == "CPU" and k == "BlockStored" for k, _, m in events)


def test_host_slots_are_reused_lru_and_report_removals() -> None:
    events: list = []
    tier = HostTier(2, lambda k, h, p, t: events.append((k, h)))
    for b, h in ((0, 10), (1, 11), (2, 12)):
        tier.offload(b, h, None, (h,))
    assert tier.get(10) is None and tier.get(12) is not None and ("BlockRemoved", 10) in events
    tier.pin([tier.get(11)])
    tier.offload(3, 13, None, (13,))  # 12 goes, 11 is pinned
    assert tier.get(11) is not None and tier.get(12) is None
    assert tier.check() == ["host tier: 1 blocks still pinned between steps"]
    tier.load(tier.get(11), 5)
    assert tier.check() == [] and tier.take_copies()[-1] == (LOAD, 5, tier.get(11).slot)


def test_accounting_over_both_tiers_after_aborts_and_preemption() -> None:
    core = engine(20, 32)
    run_with_aborts(core, sessions(3))
    assert core.scheduler.num_preemptions > 0 and core.scheduler.cache.host.num_loaded > 0
    rep = core.check_accounting()
    assert rep.ok and rep.owned == 0


def test_kv_event_wire_names_the_host_medium() -> None:
    from appliance.observability.kv_events import KVEventCollector

    c = KVEventCollector(BS)
    c("BlockStored", 7, None, (1, 2, 3, 4))
    c("BlockStored", 7, None, (1, 2, 3, 4), medium="CPU")
    c("BlockRemoved", 7, None, (), medium="CPU")
    assert c.take() == [["BlockStored", [7], None, [1, 2, 3, 4], BS], ["BlockStored", [7], None, [1, 2, 3, 4], BS,
                                                                       None, "CPU"], ["BlockRemoved", [7], "CPU"]]


def test_host_tier_size_in_gb_needs_the_block_bytes() -> None:
    import pytest

    from appliance.config import build_config
    from appliance.engine.config import host_blocks

    cache = build_config(dotlist=["cache.host_cache=true", "cache.host_cache_size_gb=1"]).cache
    assert host_blocks(cache, 100, bytes_per_block=1 << 20) == 1024
    with pytest.raises(ValueError, match="sized by the workers"):
        host_blocks(cache, 100)
    ratio = build_config(dotlist=["cache.host_cache=true", "cache.host_cache_ratio=3"]).cache
    assert host_blocks(ratio, 100) == 300 and host_blocks(build_config().cache, 100) == 0


def test_blocks_the_host_drops_spill_to_disk_and_come_back_with_the_same_outputs() -> None:
    from appliance.engine.disk_tier import FETCH, SPILL

    events: list = []
    # a host tier smaller than the device pool: without the disk most evicted history is lost
    tiered = engine(24, 8, events, disk_blocks=96)
    more_hits_than(tiered, engine(24, 8))
    disk = tiered.scheduler.cache.host.disk
    assert disk is not None and disk.num_spilled > 0 and disk.num_fetched > 0
    kinds = {c[0] for p in tiered.executor.plans for c in p.host_copies}
    assert {STORE, LOAD, SPILL, FETCH} <= kinds
    assert any(m == "DISK" and k == "BlockStored" for k, _, m in events)


def test_disk_tier_accounting_after_aborts_preemption_and_a_reset() -> None:
    core = engine(20, 6, disk_blocks=64)
    run_with_aborts(core, sessions(3))
    assert core.scheduler.num_preemptions > 0 and core.scheduler.cache.host.disk.num_fetched > 0
    core.scheduler.cache.reset()
    assert len(core.scheduler.cache.host.disk) == 0 and core.check_accounting().ok


def test_a_fetch_never_spills_over_the_disk_slot_it_reads() -> None:
    from appliance.engine.disk_tier import FETCH, SPILL, DiskTier

    disk = DiskTier(2)
    tier = HostTier(2, disk=disk)
    for b, h in ((0, 10), (1, 11), (2, 12), (3, 13)):  # 10 and 11 spill to disk as 12 and 13 take their slots
        tier.offload(b, h, None, (h,))
    assert disk.get(10) is not None and disk.get(11) is not None
    tier.take_copies()
    hit = tier.get(10)
    assert hit is not None and hit.slot == disk.get(10).slot
    (hb,) = tier.pin([hit])  # takes a host slot: 12 spills, and the disk's LRU entry is 10 itself
    copies = tier.take_copies()
    spill = next(c for c in copies if c[0] == SPILL)
    fetch = next(c for c in copies if c[0] == FETCH)
    assert spill[1] != fetch[1] == hit.slot and copies.index(spill) < copies.index(fetch)
    assert disk.get(11) is None and disk.get(12) is not None  # 11 made room instead
    tier.load(hb, 7)
    assert tier.check() == []


def test_a_chain_evicted_tail_first_lands_in_ascending_slots_and_comes_back_as_one_range() -> None:
    tier = HostTier(8)
    chain = [(10 + i, (100 + i - 1) if i else None, 100 + i) for i in range(4)]  # (block, parent hash, hash)
    for b, parent, h in reversed(chain):  # the device pool evicts a chain tail first
        tier.offload(b, h, parent, (h,))
    slots = [tier.get(h).slot for _, _, h in chain]
    assert slots == list(range(slots[0], slots[0] + 4))
    hits = tier.pin([tier.get(h) for _, _, h in chain])
    for hb, b in zip(hits, range(20, 24), strict=True):  # fresh device blocks, ascending (BlockPool.allocate)
        tier.load(hb, b)
    copies = tier.take_copies()
    assert host_runs(copies) == [HostRun(STORE, slots[0], (10, 11, 12, 13), True),
                                 HostRun(LOAD, slots[0], (20, 21, 22, 23), True)]
    # the tier full: a second chain evicted tail first recycles the first one's slots as a range again
    for i in range(4):
        tier.offload(30 + i, 200 + i, None, (200 + i,))
    tier.take_copies()
    for b, parent, h in reversed([(40 + i, (300 + i - 1) if i else None, 300 + i) for i in range(4)]):
        tier.offload(b, h, parent, (h,))
    assert [tier.get(300 + i).slot for i in range(4)] == slots
    assert len(host_runs(tier.take_copies())) == 1 and tier.check() == []
    assert tier.fetchable() == 8  # nothing free, nothing pinned: every cached slot may be taken
