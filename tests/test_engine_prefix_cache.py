"""PrefixCache: chained hashes, hits with token check, shared blocks, LRU eviction, KV events."""
from __future__ import annotations

import hashlib
import struct

import pytest

from appliance.engine import prefix_cache as pc
from appliance.engine.block_pool import BlockPool
from appliance.engine.prefix_cache import PrefixCache, hash_block
from appliance.engine.request import Request
from appliance.engine.sampling_params import SamplingParams

BS = 4


def req(tokens: list[int], rid: str = "r") -> Request:
    return Request(rid, list(tokens), SamplingParams(), 0.0)


def computed(cache: PrefixCache, tokens: list[int], rid: str = "r") -> Request:
    """A request whose tokens were all computed into freshly allocated blocks, then offered to the cache."""
    r = req(tokens, rid)
    r.block_ids = cache.pool.allocate(-(-len(tokens) // BS))
    r.num_computed_tokens = len(tokens)
    cache.store(r)
    return r


@pytest.fixture
def events() -> list[tuple]:
    return []


@pytest.fixture
def cache(events: list[tuple]) -> PrefixCache:
    return PrefixCache(BlockPool(8), BS, on_event=lambda *e: events.append(e))


def test_hash_is_chained_stable_and_64_bit() -> None:
    want = int.from_bytes(hashlib.sha256(b"\x00" + struct.pack("<4Q", 1, 2, 3, 4)).digest()[:8], "little")
    h0 = hash_block(None, [1, 2, 3, 4])
    assert h0 == want and 0 <= h0 < 2**64
    h1 = hash_block(h0, [5, 6, 7, 8])
    assert h1 != hash_block(None, [5, 6, 7, 8])  # same tokens, different parent
    assert h1 != hash_block(hash_block(None, [1, 2, 3, 5]), [5, 6, 7, 8])


def test_only_full_computed_blocks_are_stored_and_events_say_so(cache: PrefixCache, events: list) -> None:
    r = computed(cache, list(range(10)))  # 2 full blocks + a partial one
    assert len(cache) == 2
    hashes = r.block_hashes
    assert events == [
        (pc.BLOCK_STORED, hashes[0], None, (0, 1, 2, 3)),
        (pc.BLOCK_STORED, hashes[1], hashes[0], (4, 5, 6, 7)),
    ]


def test_hit_on_shared_prefix_leaves_one_token_to_compute(cache: PrefixCache) -> None:
    a = computed(cache, list(range(12)))
    assert cache.match(req(list(range(9)) + [99])) == a.block_ids[:2]
    assert cache.match(req(list(range(12)))) == a.block_ids[:2]  # full hit capped: the last token runs
    assert cache.match(req(list(range(13)))) == a.block_ids[:3]
    assert cache.match(req([0, 1, 2, 9] + list(range(4, 12)))) == []  # first block differs: chain breaks


def test_token_check_rejects_a_hash_collision(cache: PrefixCache, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pc, "hash_block", lambda parent, toks: 42)
    computed(cache, [1, 2, 3, 4, 5])
    assert cache.match(req([1, 2, 3, 4, 5])) != []
    assert cache.match(req([9, 9, 9, 9, 5])) == []  # same hash, other tokens: a miss, not a wrong hit


def test_shared_blocks_refcounts_and_lru_eviction_order(cache: PrefixCache, events: list) -> None:
    pool = cache.pool
    a = computed(cache, list(range(8)) + [100], "a")  # blocks A0 A1 + private tail
    b = req(list(range(8)) + [200], "b")
    hit = cache.match(b)
    assert hit == a.block_ids[:2]
    for blk in hit:
        pool.incref(blk)
    assert [pool.refcount(x) for x in hit] == [2, 2]
    pool.free(reversed(a.block_ids))  # a ends; b still holds the prefix
    assert [pool.refcount(x) for x in hit] == [1, 1] and pool.num_evictable == 0
    pool.free(reversed(hit))  # b ends: tail block first into the LRU
    assert pool.num_evictable == 2
    events.clear()
    pool.allocate(pool.num_free)  # drain the free list, eviction comes next
    got = pool.allocate(1)
    assert got == [a.block_ids[1]]  # the block freed first (the deeper one) is evicted first
    assert events == [(pc.BLOCK_REMOVED, a.block_hashes[1], None, ())]
    assert cache.match(req(list(range(8)) + [1])) == [a.block_ids[0]]
    assert pool.check_accounting().ok


def test_duplicate_content_stays_private(cache: PrefixCache) -> None:
    a = computed(cache, [1, 2, 3, 4, 5], "a")
    b = computed(cache, [1, 2, 3, 4, 6], "b")  # computed concurrently, without a hit
    assert len(cache) == 1 and not cache.pool.is_cached(b.block_ids[0])
    cache.pool.free(b.block_ids)
    cache.pool.free(a.block_ids)
    rep = cache.pool.check_accounting()
    assert rep.ok and rep.cached == 1


def test_reset_clears_everything_with_one_event(cache: PrefixCache, events: list) -> None:
    a = computed(cache, list(range(9)), "a")
    computed(cache, [50, 51, 52, 53, 54], "b")
    cache.pool.free(a.block_ids)  # a's blocks evictable, b's still owned
    events.clear()
    assert cache.reset() == 3
    assert events == [(pc.ALL_BLOCKS_CLEARED, None, None, ())]
    assert len(cache) == 0 and cache.match(req(list(range(9)))) == []
    rep = cache.pool.check_accounting()
    assert rep.ok and rep.cached == 0 and rep.owned == 2


def test_disabled_cache_never_hits(events: list) -> None:
    cache = PrefixCache(BlockPool(8), BS, enabled=False, on_event=lambda *e: events.append(e))
    computed(cache, list(range(9)))
    assert cache.match(req(list(range(9)))) == [] and events == [] and len(cache) == 0
