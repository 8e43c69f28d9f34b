"""BlockPool: allocation, reference counts, LRU of cached blocks, accounting."""
from __future__ import annotations

import pytest

from appliance.engine.block_pool import BlockPool, BlockPoolError, NoFreeBlocks


def test_allocate_free_roundtrip_and_accounting() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1 and pool.num_owned == 3
    rep = pool.check_accounting({b: 1 for b in a})
    assert rep.ok and (rep.free, rep.cached, rep.owned, rep.total) == (1, 0, 3, 4)
    pool.free(a)
    assert pool.num_free == 4 and pool.check_accounting({}).ok


def test_allocation_is_all_or_nothing() -> None:
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free == 1
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_double_free_and_bad_ids_raise() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free([b])
    with pytest.raises(BlockPoolError, match="out of range"):
        pool.free([7])
    with pytest.raises(BlockPoolError, match="incref of free"):
        pool.incref(b)


def test_shared_block_is_freed_only_by_last_owner() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.incref(b)
    assert pool.refcount(b) == 2
    pool.free([b])
    assert pool.refcount(b) == 1 and pool.num_free == 1
    assert not pool.check_accounting({b: 2}).ok  # a refcount that disagrees with the holders is reported
    pool.free([b])
    assert pool.num_free == 2


def test_cached_blocks_are_evicted_lru_with_callback() -> None:
    pool = BlockPool(3)
    evicted: list[int] = []
    pool.on_evict = evicted.append
    blocks = pool.allocate(3)
    for b in blocks:
        pool.mark_cached(b)
    pool.free([blocks[1], blocks[0], blocks[2]])  # LRU order: 1, 0, 2
    rep = pool.check_accounting({})
    assert rep.ok and rep.cached == 3 and rep.free == 0
    pool.incref(blocks[1])  # a hit revives it: no longer evictable
    got = pool.allocate(2)
    assert got == [blocks[0], blocks[2]] and evicted == [blocks[0], blocks[2]]
    assert not pool.is_cached(blocks[0]) and pool.is_cached(blocks[1])
    assert pool.check_accounting({b: 1 for b in blocks}).ok


def test_check_accounting_detects_corruption() -> None:
    pool = BlockPool(3)
    pool.allocate(1)
    pool._free.append(pool._free[0])  # simulate a bug: one block listed twice
    rep = pool.check_accounting()
    assert not rep.ok and rep.problems
