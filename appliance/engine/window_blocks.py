"""The sliding-window groups' blocks of every live request (pure Python, no torch): one pool, one prefix cache and
one table per request for each sliding group (kv_groups.py), beside the full-attention group's, which stays the
scheduler's `pool`, `cache` and `Request.block_ids`.

A request's table in a sliding group covers the same positions as its full table, but its entries before the
window of its next query are NULL_BLOCK: released after each step (`release`), and never taken for a prefix hit
(`admit`). A hit is the full group's hit shortened until every sliding group caches the blocks its window reads
(`hit`). Blocks are offered to each group's prefix cache as they fill (`store`); released blocks stay cached and
evictable in their pool, so a later request sharing the prefix can still hit them until they are evicted.

Shared (`shared=`, the full group's pool and prefix cache): every group's blocks come from that one pool, as in
vLLM's hybrid KV cache manager, so memory goes where the running requests need it instead of a split fixed at
start-up. The workers give each group the same number of layers (executor/window_groups.py), so a block id is the
same memory in any group. A step's growth and an admission are then checked against the pool as a sum over the
groups (`fits`, `can_take`), each group's prefix cache keeps its own hashes, and the pool's evictions go to the
cache that registered the block.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from appliance.engine.block_pool import AccountingReport, BlockPool
from appliance.engine.kv_groups import (
    NULL_BLOCK,
    KVGroup,
    first_live_block,
    max_blocks_held,
    release_outside_window,
    sliding_hit,
)
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
                 enable_prefix_caching: bool, shared: tuple[BlockPool, PrefixCache] | None = None) -> None:
        """num_blocks: each group's pool (its null block included); ignored with `shared` (the full group's pool,
        which must reserve the null block, and its prefix cache)."""
        if not groups or any(not g.sliding for g in groups) or len(groups) != len(num_blocks):
            raise ValueError("WindowBlocks takes the sliding groups, each with its pool's block count")
        if shared is not None and not shared[0].null_block:
            raise ValueError("a pool the sliding groups share must reserve the null block")
        self.groups = tuple(groups)
        self.windows = tuple(g.window for g in groups if g.window is not None)
        self.block_size = block_size
        self.shared = shared[0] if shared is not None else None
        self.pools = ([self.shared] * len(groups) if self.shared is not None
                      else [BlockPool(n, null_block=True) for n in num_blocks])
        # no KV events: the full group's cache publishes the prefix, and the host tier holds full groups only
        self.caches = [PrefixCache(p, block_size, enable_prefix_caching) for p in self.pools]
        self._owners = (shared[1], *self.caches) if shared is not None else ()
        if self.shared is not None:  # one pool, one on_evict: to whichever cache registered the block
            self.shared.on_evict = self._evicted
        self.tables: dict[str, list[WindowTable]] = {}

    def _evicted(self, block_id: int) -> None:
        for cache in self._owners:
            if cache.holds(block_id):
                cache.evicted(block_id)
                return
        raise RuntimeError(f"the shared pool evicted block {block_id}, which no prefix cache registered")

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

    def fits(self, req: Request, num_hit_blocks: int, end: int, full_need: int = 0) -> bool:
        """Whether every group can give a request admitted with this hit the blocks up to token `end` (the
        window's hit blocks that are evictable count against the pool, as they are revived). full_need: what
        the full group takes of a shared pool for the same request (fresh and revived blocks)."""
        total = full_need
        for w, pool, cache in zip(self.windows, self.pools, self.caches):
            lo = first_live_block(num_hit_blocks * self.block_size, w, self.block_size)
            hits = [cache.cached_at(req, i) for i in range(lo, num_hit_blocks)]
            revived = sum(1 for b in hits if b is not None and pool.is_evictable(b))
            need = self._blocks_for(end) - num_hit_blocks + revived
            if need > pool.num_available:
                return False
            total += need
        return self.shared is None or total <= self.shared.num_available

    def admit(self, req: Request, num_hit_blocks: int, end: int) -> list[list[int]]:
        """The request's tables: null entries before the hit's window, the window's cached blocks (referenced),
        then fresh blocks up to token `end`. `fits` must have said yes. Returns each group's table."""
        if req.request_id in self.tables:
            raise ValueError(f"request {req.request_id!r} already holds window blocks")
        bs = self.block_size
        hits = []
        for w, cache in zip(self.windows, self.caches):
            lo = first_live_block(num_hit_blocks * bs, w, bs)
            group_hits = [cache.cached_at(req, i) for i in range(lo, num_hit_blocks)]
            if any(b is None for b in group_hits):
                raise ValueError(f"request {req.request_id!r}: the window of a hit of {num_hit_blocks} blocks is "
                                 "not cached (shorten it with `hit` first)")
            hits.append((lo, group_hits))
        for pool, (_, group_hits) in zip(self.pools, hits):  # every group's hits taken before any allocation,
            for b in group_hits:  # which could evict them (a shared pool: another group's)
                pool.incref(b)  # type: ignore[arg-type]
        tables = []
        for pool, (lo, group_hits) in zip(self.pools, hits):
            fresh = pool.allocate(self._blocks_for(end) - num_hit_blocks)
            table = [NULL_BLOCK] * lo + group_hits + fresh  # type: ignore[operator]
            tables.append(WindowTable(table, lo, num_hit_blocks))
        self.tables[req.request_id] = tables
        return [t.block_ids for t in tables]

    # ---- running -----------------------------------------------------------------------------------------
    def can_take(self, need: int) -> bool:
        """Whether every group's pool can give `need` blocks (a request's tables grow with its full table); a
        shared pool gives the full group's `need` too."""
        if self.shared is not None:
            return need * (len(self.groups) + 1) <= self.shared.num_available
        return all(need <= pool.num_available for pool in self.pools)

    def room(self, running: Sequence[Request], req: Request, num_hit_blocks: int, end: int) -> int:
        """Blocks of a shared pool the sliding groups need for `req` admitted with this hit up to token `end`, and
        then for every request's growth: a group's table grows with its request until it holds the window's blocks
        or the request's last token's (what the output reservation, admission.py, counts in the full group)."""
        bs = self.block_size
        total = 0
        for r in running:
            last = self._blocks_for(r.num_prompt_tokens + r.max_output_tokens)
            for w, t in zip(self.windows, self.tables.get(r.request_id, ())):
                total += max(0, min(last, max_blocks_held(w, bs)) - (len(t.block_ids) - t.released))
        last = self._blocks_for(req.num_prompt_tokens + req.max_output_tokens)
        for w in self.windows:  # its table now (null entries before the hit's window hold nothing), or its peak
            now = self._blocks_for(end) - first_live_block(num_hit_blocks * bs, w, bs)
            total += max(now, min(last, max_blocks_held(w, bs)))
        return total

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

    def refs(self, g: int) -> dict[int, int]:
        """Block id -> how many live tables of group g hold it (null entries hold nothing)."""
        refs: dict[int, int] = {}
        for tables in self.tables.values():
            for b in tables[g].block_ids:
                if b != NULL_BLOCK:
                    refs[b] = refs.get(b, 0) + 1
        return refs

    def check_accounting(self) -> list[AccountingReport]:
        """Each pool's report against the live tables' references; none when the pool is shared (its report
        counts every group's tables: engine/core.py)."""
        if self.shared is not None:
            return []
        return [pool.check_accounting(self.refs(g)) for g, pool in enumerate(self.pools)]

    def reset_caches(self) -> None:
        """Forget every cached block of the sliding groups (a prefix-cache reset; after the full group's, whose
        reset of a shared pool evicted theirs unannounced)."""
        for cache in self.caches:
            cache.reset()

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
