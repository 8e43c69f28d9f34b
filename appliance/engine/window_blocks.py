"""The sliding-window groups' blocks of every live request (pure Python, no torch): one pool, one prefix cache and
one table per request for each sliding group (kv_groups.py), beside the full-attention group's, which stays the
scheduler's `pool`, `cache` and `Request.block_ids`.

A request's table in a sliding group covers the same positions as its full table, but its entries before the
window of its next query are NULL_BLOCK: released after each step (`release`), and never taken for a prefix hit
(`admit`). A hit is the full group's hit shortened until every sliding group caches the blocks its window reads
(`hit`). Blocks are offered to each group's prefix cache as they fill (`store`); released blocks stay cached and
evictable in their pool, so a later request sharing the prefix can still hit them until they are evicted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from appliance.engine.block_pool import AccountingReport, BlockPool
from appliance.engine.kv_groups import NULL_BLOCK, KVGroup, first_live_block, release_outside_window, sliding_hit
from appliance.engine.prefix_cache import PrefixCache
from appliance.engine.request import Request


@dataclass
class WindowTable:
    """A request's block table in one sliding group."""

    block_ids: list[int] = field(default_factory=list)
    released: int = 0  # leading entries that are NULL_BLOCK
    num_stored: int = 0  # leading blocks offered to the group's prefix cache


class WindowBlocks:
    def __init__(self, groups: Sequence[KVGroup], num_blocks: Sequence[int], block_size: int,
                 enable_prefix_caching: bool) -> None:
        if not groups or any(not g.sliding for g in groups) or len(groups) != len(num_blocks):
            raise ValueError("WindowBlocks takes the sliding groups, each with its pool's block count")
        self.groups = tuple(groups)
        self.windows = tuple(g.window for g in groups if g.window is not None)
        self.block_size = block_size
        self.pools = [BlockPool(n, null_block=True) for n in num_blocks]
        # no KV events: the full group's cache publishes the prefix, and the host tier holds full groups only
        self.caches = [PrefixCache(p, block_size, enable_prefix_caching) for p in self.pools]
        self.tables: dict[str, list[WindowTable]] = {}

    # ---- admission ---------------------------------------------------------------------------------------
    def hit(self, req: Request, num_blocks: int) -> int:
        """Shorten a hit of `num_blocks` (the full group's) until every sliding group caches the blocks the
        queries after it read. Each group's rule is not closed under shortening, so it repeats to a fixpoint."""
        bs = self.block_size
        while True:
            n = num_blocks
            for w, cache in zip(self.windows, self.caches):
                n = sliding_hit(n, lambda i, c=cache: c.cached_at(req, i) is not None, w, bs)
            if n == num_blocks:
                return n
            num_blocks = n

    def fits(self, req: Request, num_hit_blocks: int, end: int) -> bool:
        """Whether every group can give a request admitted with this hit the blocks up to token `end` (the
        window's hit blocks that are evictable count against the pool, as they are revived)."""
        for w, pool, cache in zip(self.windows, self.pools, self.caches):
            lo = first_live_block(num_hit_blocks * self.block_size, w, self.block_size)
            hits = [cache.cached_at(req, i) for i in range(lo, num_hit_blocks)]
            revived = sum(1 for b in hits if b is not None and pool.is_evictable(b))
            if self._blocks_for(end) - num_hit_blocks + revived > pool.num_available:
                return False
        return True

    def admit(self, req: Request, num_hit_blocks: int, end: int) -> list[list[int]]:
        """The request's tables: null entries before the hit's window, the window's cached blocks (referenced),
        then fresh blocks up to token `end`. `fits` must have said yes. Returns each group's table."""
        if req.request_id in self.tables:
            raise ValueError(f"request {req.request_id!r} already holds window blocks")
        bs = self.block_size
        tables = []
        for w, pool, cache in zip(self.windows, self.pools, self.caches):
            lo = first_live_block(num_hit_blocks * bs, w, bs)
            hits = [cache.cached_at(req, i) for i in range(lo, num_hit_blocks)]
            if any(b is None for b in hits):
                raise ValueError(f"request {req.request_id!r}: the window of a hit of {num_hit_blocks} blocks is "
                                 "not cached (shorten it with `hit` first)")
            for b in hits:  # referenced before allocating, so the allocation cannot evict them
                pool.incref(b)  # type: ignore[arg-type]
            fresh = pool.allocate(self._blocks_for(end) - num_hit_blocks)
            tables.append(WindowTable([NULL_BLOCK] * lo + hits + fresh, lo, num_hit_blocks))  # type: ignore[operator]
        self.tables[req.request_id] = tables
        return [t.block_ids for t in tables]

    # ---- running -----------------------------------------------------------------------------------------
    def can_take(self, need: int) -> bool:
        """Whether every group's pool can give `need` blocks (a request's tables grow with its full table)."""
        return all(need <= pool.num_available for pool in self.pools)

    def take(self, req: Request, need: int) -> list[list[int]]:
        """Append `need` fresh blocks to each of the request's tables; returns each group's new ids."""
        out = []
        for pool, table in zip(self.pools, self.tables[req.request_id]):
            new = pool.allocate(need)
            table.block_ids.extend(new)
            out.append(new)
        return out

    def after_step(self, req: Request, start: int) -> None:
        """Offer newly full blocks to the prefix caches, then release the blocks no query from position
        `start` on reads (stored first, so a released block stays cached and evictable)."""
        for w, pool, cache, table in zip(self.windows, self.pools, self.caches, self.tables[req.request_id]):
            table.num_stored = cache.store_table(req, table.block_ids, table.num_stored)
            table.released = release_outside_window(table.block_ids, table.released, start, w, self.block_size,
                                                    pool)

    def free(self, req: Request) -> None:
        """All of a finished, aborted or preempted request's blocks, tail first (its prefix is evicted last)."""
        for pool, table in zip(self.pools, self.tables.pop(req.request_id, [])):
            pool.free(b for b in reversed(table.block_ids) if b != NULL_BLOCK)

    # ---- introspection -----------------------------------------------------------------------------------
    def held(self, req: Request) -> list[int]:
        """Blocks the request holds in each group (its non-null entries)."""
        return [sum(1 for b in t.block_ids if b != NULL_BLOCK) for t in self.tables.get(req.request_id, [])]

    def check_accounting(self) -> list[AccountingReport]:
        """Each pool's report against the live tables' references (null entries hold nothing)."""
        reports = []
        for g, pool in enumerate(self.pools):
            refs: dict[int, int] = {}
            for tables in self.tables.values():
                for b in tables[g].block_ids:
                    if b != NULL_BLOCK:
                        refs[b] = refs.get(b, 0) + 1
            reports.append(pool.check_accounting(refs))
        return reports

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
