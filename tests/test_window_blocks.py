"""WindowBlocks (engine/window_blocks.py): the sliding groups' tables over a request's life. Chunked prefill,
decode past the window, prefix hits (whole, shortened by eviction, re-admission after preemption): every key a
query reads stays held, the blocks held stay within the window's bound, and every block is accounted for."""
from __future__ import annotations

import random

import pytest

from appliance.engine.kv_groups import NULL_BLOCK, first_live_block, kv_groups, max_blocks_held
from appliance.engine.request import Request
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.window_blocks import WindowBlocks

BS = 4


def make(windows: tuple[int, ...], blocks: int = 64, caching: bool = True) -> WindowBlocks:
    groups = [g for g in kv_groups([*windows, None]) if g.sliding]
    return WindowBlocks(groups, [blocks] * len(groups), BS, caching)


def request(tokens: list[int], rid: str) -> Request:
    return Request(rid, list(tokens), SamplingParams(), 0.0)


def check(wb: WindowBlocks) -> None:
    for rep in wb.check_accounting():
        assert rep.ok, rep.problems


def step(wb: WindowBlocks, req: Request, n: int) -> None:
    """Compute tokens [computed, computed + n): grow the tables, check every query's keys are held (the null
    entries are outside every window), then advance and release."""
    start = req.num_computed_tokens
    end = start + n
    need = -(-end // BS) - len(wb.tables[req.request_id][0].block_ids)
    if need > 0:
        assert wb.can_take(need)
        assert [len(new) for new in wb.take(req, need)] == [need] * len(wb.pools)
    for w, table in zip(wb.windows, wb.tables[req.request_id]):
        assert len(table.block_ids) * BS >= end
        for p in range(start, end):
            for k in range(max(0, p - w + 1), p + 1):
                assert table.block_ids[k // BS] != NULL_BLOCK, (p, k)
    req.num_computed_tokens = end
    wb.after_step(req, end)
    for w, held in zip(wb.windows, wb.held(req)):
        assert held == -(-end // BS) - first_live_block(end, w, BS)  # from the next query's oldest key's block on
    check(wb)


def admit(wb: WindowBlocks, req: Request, full_hit: int, chunk: int) -> int:
    n = wb.hit(req, full_hit)
    end = min(req.num_tokens, n * BS + chunk)
    assert wb.fits(req, n, end)
    wb.admit(req, n, end)
    req.num_computed_tokens = n * BS
    check(wb)
    return n


@pytest.mark.parametrize("windows", [(6,), (5, 9), (1,), (16,)])
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_prefill_in_chunks_then_decode_past_the_window(windows: tuple[int, ...], chunk: int) -> None:
    wb = make(windows)
    req = request(list(range(1, 31)), "a")
    admit(wb, req, 0, chunk)
    while req.num_computed_tokens < req.num_tokens:
        step(wb, req, min(chunk, req.num_tokens - req.num_computed_tokens))
    for t in range(40):  # decode: one token per step, well past every window
        req.output_token_ids.append(100 + t)
        step(wb, req, 1)
        for w, held in zip(wb.windows, wb.held(req)):
            assert held <= max_blocks_held(w, BS) <= -(-w // BS) + 1
    wb.free(req)
    check(wb)
    assert [p.num_owned for p in wb.pools] == [0] * len(windows)


def test_hit_takes_only_the_window_and_is_shortened_when_it_was_evicted() -> None:
    wb = make((6,), blocks=12)
    prompt = list(range(1, 25))  # 6 full blocks
    a = request(prompt, "a")
    admit(wb, a, 0, 24)
    step(wb, a, 24)
    assert wb.held(a) == [2]  # blocks 4 and 5: the window of the query at 24 (keys 19..24)
    # same prompt and more: a full hit of 6 blocks keeps the window (blocks 4, 5 shared), nulls before it
    b = request(prompt + [7, 8], "b")
    assert admit(wb, b, 6, 8) == 6
    tb = wb.tables["b"][0]
    assert tb.block_ids[:4] == [NULL_BLOCK] * 4 and tb.block_ids[4:6] == wb.tables["a"][0].block_ids[4:6]
    assert wb.pools[0].refcount(tb.block_ids[4]) == 2
    step(wb, b, 2)
    wb.free(a)
    wb.free(b)
    check(wb)
    # a prompt that diverges in block 4 hits 4 blocks in the full group; its window reads blocks 2 and 3, released
    # but still cached (evictable) in the sliding pool
    c = request(prompt[:16] + [9] * 8, "c")
    assert wb.hit(c, 4) == 4
    # fill the pool: allocations evict the LRU cached blocks, released first (a's 0..3, tail first within a
    # release), so the window of a 4-block hit goes and the hit shortens
    filler = request(list(range(500, 500 + 4 * (wb.pools[0].num_free + 4))), "f")
    admit(wb, filler, 0, 4 * (wb.pools[0].num_free + 4))  # evicts a's blocks 0..3
    assert [wb.caches[0].cached_at(c, i) is None for i in range(4)] == [True] * 4
    assert wb.hit(c, 4) == 0  # every shorter hit's window reads an evicted block too: the prompt is recomputed
    wb.free(filler)
    check(wb)


def test_two_windows_hit_reaches_a_fixpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each group's hit rule alone is not closed under shortening: shortening for the wide window can leave the
    narrow one's window uncached, so the hit repeats until both agree. With blocks of 4, a hit of n blocks reads
    block n - 1 in the window of 4 and blocks n - 2, n - 1 in the window of 8."""
    wb = make((4, 8))
    missing = {0: {7}, 1: {8}}  # narrow: block 7 evicted; wide: block 8 evicted
    for g, cache in enumerate(wb.caches):
        monkeypatch.setattr(cache, "cached_at", lambda req, i, g=g: None if i in missing[g] else 1)
    q = request(list(range(1, 42)), "q")
    # one pass would stop at 8: narrow allows 10, wide shortens to 8, whose block 7 the narrow group lacks
    assert wb.hit(q, 10) == 7

    def valid(m: int) -> bool:
        return all(i not in missing[g] for g, w in enumerate((4, 8)) for i in range(first_live_block(m * BS, w, BS), m))
    assert valid(7) and not any(valid(m) for m in range(8, 11))


def test_preempted_request_frees_everything_and_comes_back_through_its_own_blocks() -> None:
    wb = make((6,), blocks=16)
    a = request(list(range(1, 23)), "a")
    admit(wb, a, 0, 8)
    step(wb, a, 8)
    step(wb, a, 8)
    wb.free(a)  # preempted: recompute from a hit of the blocks it stored
    check(wb)
    assert wb.pools[0].num_owned == 0
    n = admit(wb, a, 4, 8)  # the full group hit 4 blocks; the window of a query at 16 reads blocks 2 and 3
    assert n == 4 and wb.held(a) == [2 + 2]  # the window's 2 cached blocks and 2 fresh ones for 8 more tokens
    while a.num_computed_tokens < a.num_tokens:
        step(wb, a, min(8, a.num_tokens - a.num_computed_tokens))
    wb.free(a)
    check(wb)


def test_random_requests_keep_every_block_accounted() -> None:
    rng = random.Random(1)
    wb = make((5, 12), blocks=48)
    shared = [rng.randrange(1, 50) for _ in range(20)]
    live: dict[str, Request] = {}
    for i in range(60):
        if live and (rng.random() < 0.3 or len(live) > 3):
            rid = rng.choice(sorted(live))
            wb.free(live.pop(rid))
            check(wb)
            continue
        prompt = shared[: rng.randrange(1, 21)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 12))]
        req = request(prompt, f"r{i}")
        full = 0
        while full < (req.num_tokens - 1) // BS and all(c.cached_at(req, full) is not None for c in wb.caches):
            full += 1  # stand-in for the full group's hit: some prefix the sliding caches may know
        n = wb.hit(req, full)
        chunk = rng.choice([1, 4, 7, 32])
        end = min(req.num_tokens, n * BS + chunk)
        if not wb.fits(req, n, end):
            continue
        wb.admit(req, n, end)
        req.num_computed_tokens = n * BS
        live[req.request_id] = req
        while req.num_computed_tokens < req.num_tokens:
            end = min(req.num_tokens, req.num_computed_tokens + chunk)
            if not wb.can_take(-(-end // BS) - len(wb.tables[req.request_id][0].block_ids)):
                break
            step(wb, req, end - req.num_computed_tokens)
    for req in live.values():
        wb.free(req)
    check(wb)
    assert all(p.num_owned == 0 for p in wb.pools)
