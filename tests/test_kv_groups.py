"""KV cache groups (engine/kv_groups.py): grouping by window, the window's block arithmetic against a brute-force
mask, releasing out-of-window blocks into null entries with exact block accounting, the prefix-cache hit rule of
a sliding group, and the memory plan's split."""
from __future__ import annotations

import random

import pytest

from appliance.engine.block_pool import BlockPool, BlockPoolError
from appliance.engine.kv_groups import (NULL_BLOCK, KVGroup, first_live_block, kv_groups, max_blocks_held,
                                        plan_blocks, release_outside_window, sliding_hit)
from appliance.engine.prefix_cache import PrefixCache
from appliance.engine.request import Request
from appliance.engine.sampling_params import SamplingParams


def test_groups_put_full_attention_first_then_windows_narrowest_first() -> None:
    # Gemma 3's pattern: five local layers per global one
    windows = [8, 8, 8, 8, 8, None, 8, 4, None]
    groups = kv_groups(windows)
    assert groups == (KVGroup(None, (5, 8)), KVGroup(4, (7,)), KVGroup(8, (0, 1, 2, 3, 4, 6)))
    assert [g.sliding for g in groups] == [False, True, True]
    assert kv_groups([None, None]) == (KVGroup(None, (0, 1)),)  # no sliding layers: one group, as today
    assert kv_groups([16, 16]) == (KVGroup(16, (0, 1)),)
    with pytest.raises(ValueError, match="at least 1"):
        kv_groups([0, None])
    with pytest.raises(ValueError, match="no KV cache groups"):
        kv_groups([])


@pytest.mark.parametrize("window,bs", [(1, 4), (3, 4), (4, 4), (5, 4), (8, 4), (9, 16), (33, 16)])
def test_first_live_block_is_the_oldest_block_any_later_query_reads(window: int, bs: int) -> None:
    for start in range(0, 3 * window + 3 * bs):
        # brute force over queries p >= start: key k is visible when k > p - window (and k <= p)
        oldest = min(k for p in range(start, start + 2 * bs + window) for k in range(p + 1) if k > p - window)
        assert first_live_block(start, window, bs) == oldest // bs
        # once decoding, the blocks from there to the block being written are at most max_blocks_held
        assert start // bs - first_live_block(start, window, bs) + 1 <= max_blocks_held(window, bs)
    # and the bound is reached: some position straddles a block boundary (unless every key is one block)
    worst = max(s // bs - first_live_block(s, window, bs) + 1 for s in range(4 * window + 4 * bs))
    assert worst == max_blocks_held(window, bs) <= -(-window // bs) + 1


def test_release_frees_only_blocks_outside_every_window_and_keeps_accounting() -> None:
    bs, window = 4, 6
    pool = BlockPool(32, null_block=True)
    table: list[int] = []
    released = 0
    peak = 0
    for p in range(60):  # decode: the step of position p needs its block, then releases what p + 1 cannot see
        if len(table) <= p // bs:
            table += pool.allocate(1)
        live = [b for b in table if b != NULL_BLOCK]
        peak = max(peak, len(live))
        assert len(live) <= max_blocks_held(window, bs)
        for k in range(max(0, p - window + 1), p + 1):  # the keys the query at p reads are all held
            assert table[k // bs] != NULL_BLOCK
        report = pool.check_accounting({b: 1 for b in live})
        assert report.ok, report.problems
        assert report.owned == len(live) and report.total == 31
        released = release_outside_window(table, released, p + 1, window, bs, pool)
        assert table[:released] == [NULL_BLOCK] * released and NULL_BLOCK not in table[released:]
        assert released == first_live_block(p + 1, window, bs)
    assert peak == max_blocks_held(window, bs)
    # releasing again from the same position changes nothing
    assert release_outside_window(table, released, 60, window, bs, pool) == released


def test_null_block_is_never_allocated_and_never_freed() -> None:
    pool = BlockPool(4, null_block=True)
    assert pool.num_usable == 3 and pool.num_free == 3
    got = pool.allocate(3)
    assert NULL_BLOCK not in got and sorted(got) == [1, 2, 3]
    for misuse in (lambda: pool.free([NULL_BLOCK]), lambda: pool.incref(NULL_BLOCK),
                   lambda: pool.mark_cached(NULL_BLOCK)):
        with pytest.raises(BlockPoolError, match="null block"):
            misuse()
    assert pool.usage() == 1.0
    with pytest.raises(ValueError):
        BlockPool(1, null_block=True)


def _brute_sliding_hit(n: int, cached: set[int], window: int, bs: int) -> int:
    for k in range(n, 0, -1):
        if all(i in cached for i in range(first_live_block(k * bs, window, bs), k)):
            return k
    return 0


def test_sliding_hit_matches_brute_force() -> None:
    rng = random.Random(0)
    for _ in range(400):
        bs = rng.choice([1, 2, 4])
        window = rng.randint(1, 12)
        n = rng.randint(0, 12)
        cached = {i for i in range(n) if rng.random() < 0.7}
        assert sliding_hit(n, cached.__contains__, window, bs) == _brute_sliding_hit(n, cached, window, bs)


def _request(tokens: list[int], rid: str) -> Request:
    return Request(rid, list(tokens), SamplingParams(), 0.0)


def test_prefix_hit_needs_the_sliding_groups_last_window() -> None:
    """A request computed 6 blocks; its sliding group released the first ones (cached, evictable). A second
    request with the same prompt hits all 5 blocks it may (one token stays to compute) while the window is still
    cached; once evictions take a block of that window, the hit shortens to where a whole window is cached."""
    bs, window = 4, 6
    full, slide = PrefixCache(BlockPool(16), bs), PrefixCache(BlockPool(16, null_block=True), bs)
    tokens = list(range(100, 124))  # 6 full blocks
    first = _request(tokens, "a")
    first.block_ids = slide.pool.allocate(6)
    first.num_computed_tokens = len(tokens)
    slide.store(first)
    released = release_outside_window(first.block_ids, 0, len(tokens), window, bs, slide.pool)
    assert released == first_live_block(24, window, bs) == 4 and len(slide) == 6
    full_first = _request(tokens, "a")
    full_first.block_ids = full.pool.allocate(6)
    full_first.num_computed_tokens = len(tokens)
    full.store(full_first)

    second = _request(tokens + [7], "b")
    hit = full.match(second)
    assert len(hit) == 6 == full.max_hit_blocks(second)
    n = sliding_hit(len(hit), lambda i: slide.cached_at(second, i) is not None, window, bs)
    assert n == 6  # the window of a query at 24 reads blocks 4 and 5, both held by the first request

    third = _request(tokens[:20] + [7], "c")  # diverges in block 5: hit of 5 blocks, window blocks 3 and 4
    assert len(full.match(third)) == 5
    assert sliding_hit(5, lambda i: slide.cached_at(third, i) is not None, window, bs) == 5
    filler = slide.pool.allocate(slide.pool.num_free)  # no free blocks left: allocations evict cached ones, LRU first
    slide.pool.allocate(2)  # evicts released blocks 0 and 1 of the first request (released in table order)
    assert slide.cached_at(third, 0) is None and slide.cached_at(third, 3) is not None
    assert sliding_hit(5, lambda i: slide.cached_at(third, i) is not None, window, bs) == 5
    slide.pool.allocate(2)  # now blocks 2 and 3 go too
    assert sliding_hit(5, lambda i: slide.cached_at(third, i) is not None, window, bs) == 0
    assert sliding_hit(6, lambda i: slide.cached_at(second, i) is not None, window, bs) == 6  # 4, 5 still held
    # a table whose leading entries are null (a hit's blocks before its window) stores only the blocks it holds
    slide.pool.free(filler)
    stored = len(slide)
    fourth = _request(list(range(200, 216)), "d")
    fourth.block_ids = [NULL_BLOCK, NULL_BLOCK] + slide.pool.allocate(2)
    fourth.num_computed_tokens = 16
    slide.store(fourth)
    assert len(slide) == stored + 2 and all(slide.cached_at(fourth, i) is None for i in (0, 1))
    assert [slide.cached_at(fourth, i) for i in (2, 3)] == fourth.block_ids[2:]
    assert slide.pool.check_accounting().ok


def test_blocks_held_and_the_memory_plan() -> None:
    bs, ctx = 16, 32768
    groups = kv_groups([1024] * 5 + [None])  # one global layer per five local ones, as Gemma 3
    full, local = groups
    assert full.blocks_held(ctx, bs) == 2048
    assert local.blocks_held(ctx, bs) == max_blocks_held(1024, bs) == 65
    assert local.blocks_held(100, bs) == 7  # shorter than the window: every block
    assert local.blocks_held(ctx, bs, chunk=2048) == 193  # a chunk's 2048 keys and the 1023 before, unaligned
    layer_block = 2 * bs * 8 * 256 * 2  # K and V of one layer, 8 kv heads of 256, bf16
    per_seq = (2048 * 1 + 65 * 5) * layer_block
    budget = 10 * per_seq + 5 * layer_block  # ten sequences and the sliding pool's null block
    assert plan_blocks(budget, groups, layer_block, ctx, bs) == (2048 * 10, 65 * 10 + 1)
    # ten and a half sequences: the half is split too, in the same proportion, and no more than the budget
    more = budget + per_seq // 2
    full_blocks, local_blocks = plan_blocks(more, groups, layer_block, ctx, bs)
    assert (full_blocks, local_blocks) == (2048 * 21 // 2, 65 * 21 // 2 + 1)
    spent = (full_blocks * 1 + local_blocks * 5) * layer_block
    assert more - 6 * layer_block < spent <= more  # less than one block of each layer is left over
    share = (2048 + 65 * 5) / (2048 * 6)  # the KV a sequence costs against every layer keeping the context
    assert share < 1 / 5
    with pytest.raises(ValueError, match="holds no sequence"):
        plan_blocks(per_seq - 1, groups, layer_block, ctx, bs)
    only_full = kv_groups([None, None])
    assert plan_blocks(3 * 2 * 2048 * layer_block, only_full, layer_block, ctx, bs) == (3 * 2048,)
