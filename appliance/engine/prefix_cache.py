"""Prefix caching over full KV blocks, keyed by chained block hashes (pure Python, no torch).

Block i of a token sequence hashes (hash of block i-1, the block's token ids), so equal hashes mean equal
prefixes up to that block. Hashes are sha256 truncated to 64 bits: stable across processes and runs, which
matters because they are published as KV events (BlockStored / BlockRemoved) that routers compare. A hit is
confirmed by comparing token ids (and the parent hash), so a hash collision can cost a miss, never a wrong
answer. Only full blocks are cached; the partially filled tail block of a request is private to it.

Blocks are shared, not copied: a hit takes a reference on the cached block. Unreferenced cached blocks wait in
the pool's LRU and are evicted when the free list runs out (see block_pool.py).
"""
from __future__ import annotations

import hashlib
import struct
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from appliance.engine.block_pool import BlockPool
from appliance.engine.disk_tier import DISK_MEDIUM, DiskBlock, DiskTier
from appliance.engine.host_tier import HOST_MEDIUM, HostBlock, HostTier
from appliance.engine.request import Request

if TYPE_CHECKING:
    from appliance.engine.state_snapshots import StateSnapshots

BLOCK_STORED = "BlockStored"
BLOCK_REMOVED = "BlockRemoved"
ALL_BLOCKS_CLEARED = "AllBlocksCleared"


class KVEventSink(Protocol):
    """Receives every mutation of the cache, in order; the observability layer publishes them.

    kind is BLOCK_STORED, BLOCK_REMOVED or ALL_BLOCKS_CLEARED; for removals parent_hash is None and
    token_ids empty, for a clear block_hash is None too. medium is given ("CPU") only for the host tier's
    blocks (host_tier.py); without it the event is the device's.
    """

    def __call__(
        self, kind: str, block_hash: int | None, parent_hash: int | None, token_ids: tuple[int, ...],
        medium: str | None = None
    ) -> None: ...


def hash_block(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained 64-bit hash of one block: stable across processes, < 2**64."""
    h = hashlib.sha256()
    h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(token_ids)}Q", *token_ids))
    return int.from_bytes(h.digest()[:8], "little")


@dataclass(frozen=True)
class CachedBlock:
    block_id: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class PrefixCache:
    def __init__(
        self, pool: BlockPool, block_size: int, enabled: bool = True, on_event: KVEventSink | None = None,
        host_slots: int = 0, disk_slots: int = 0, write_through: bool = False
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self.enabled = enabled
        self.on_event = on_event
        self._by_hash: dict[int, int] = {}
        self._by_block: dict[int, CachedBlock] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0
        pool.on_evict = self._on_evict
        # the host-memory tier (host_tier.py): evicted blocks are copied there; None without one
        # and the disk tier behind it (disk_tier.py): blocks the host tier drops are spilled there
        disk = DiskTier(disk_slots, self._emit_disk) if disk_slots and host_slots and enabled else None
        self.host = HostTier(host_slots, self._emit_host, disk) if host_slots and enabled else None
        # write-through (cache.host_cache_write_policy): hashes of device blocks cached since, not yet copied to
        # the host; None under write-back (a block is copied when evicted)
        self._unwritten: deque[int] | None = deque() if write_through and self.host is not None else None

    # ---- hashing -----------------------------------------------------------------------------------------
    def block_hashes(self, req: Request) -> list[int]:
        """The request's chained hashes for all its full blocks (computed once, extended as it grows)."""
        bs = self.block_size
        hashes = req.block_hashes
        for i in range(len(hashes), req.num_tokens // bs):
            parent = hashes[i - 1] if i else None
            hashes.append(hash_block(parent, req.token_slice(i * bs, (i + 1) * bs)))
        return hashes

    # ---- lookup ------------------------------------------------------------------------------------------
    def match(self, req: Request) -> list[int]:
        """Block ids of the longest cached prefix of `req` (no references taken).

        At least one token is left uncomputed, because the model must run on the last token to sample.
        """
        if not self.enabled:
            return []
        out: list[int] = []
        for i in range(self.max_hit_blocks(req)):
            b = self.cached_at(req, i)
            if b is None:
                break
            out.append(b)
        return out

    def max_hit_blocks(self, req: Request) -> int:
        """The longest hit `req` may have, in blocks: its last token is always computed, to sample."""
        return (req.num_tokens - 1) // self.block_size

    def cached_at(self, req: Request, i: int) -> int | None:
        """The cached block holding block i of `req` (its chained hash, parent and tokens confirmed), or None.
        A sliding-window group's cache (kv_groups.py) asks block by block: its hit needs the last window only."""
        if not self.enabled:
            return None
        bs = self.block_size
        hashes = self.block_hashes(req)
        b = self._by_hash.get(hashes[i])
        if b is None:
            return None
        cb = self._by_block[b]
        if cb.parent_hash != (hashes[i - 1] if i else None):
            return None
        if cb.token_ids != tuple(req.token_slice(i * bs, (i + 1) * bs)):
            return None
        return b

    def lookup(self, req: Request, drafter_reads_next: bool, snapshots: StateSnapshots | None
               ) -> tuple[list[int], list[HostBlock | DiskBlock], int, int]:
        """Admission's prefix hit over every tier: (device hit blocks, host / disk hit blocks, the state snapshot to
        restore or -1, tokens hit)."""
        # Prompt logprobs need logits at every prompt position, so such requests skip the cache.
        hit = self.match(req) if req.sampling_params.prompt_logprobs is None else []
        host_hit = self.match_host(req, len(hit)) if req.sampling_params.prompt_logprobs is None else []
        if drafter_reads_next:
            # the drafter's cache at the hit's last position saw another next token (speculation.py)
            if host_hit:
                host_hit = host_hit[:-1]
            elif hit:
                hit = hit[:-1]
        restore = -1
        if (hit or host_hit) and snapshots is not None:  # the KV alone is no prefix: its state must be restored
            k, restore = snapshots.deepest(self.block_hashes(req), len(hit) + len(host_hit))
            hit, host_hit = hit[:k], host_hit[:max(0, k - len(hit))]
        return hit, host_hit, restore, (len(hit) + len(host_hit)) * self.block_size

    def match_host(self, req: Request, start: int) -> list[HostBlock | DiskBlock]:
        """The host (then disk) tier's blocks that continue a device hit of `start` blocks (same last-token rule);
        disk hits only as many as host slots can be had for them (HostTier.pin fetches them)."""
        if self.host is None:
            return []
        bs = self.block_size
        hashes = self.block_hashes(req)
        out: list[HostBlock | DiskBlock] = []
        room = self.host.fetchable()  # each hit uses one: a host hit is pinned, a disk hit takes a slot
        for i in range(start, (req.num_tokens - 1) // bs):
            hb = self.host.get(hashes[i])
            if (hb is None or hb.parent_hash != (hashes[i - 1] if i else None)
                    or hb.token_ids != tuple(req.token_slice(i * bs, (i + 1) * bs)) or room == 0):
                break
            room -= 1
            out.append(hb)
        return out

    def load_host(self, hits: list[HostBlock], block_ids: list[int]) -> None:
        """Queue the copies of host hits into fresh owned device blocks and register those in the cache."""
        assert self.host is not None
        for hb, b in zip(hits, block_ids, strict=True):
            self.host.load(hb, b)
            if hb.block_hash in self._by_hash:
                continue  # another request brought it back meanwhile: this copy stays private
            self._by_hash[hb.block_hash] = b
            self._by_block[b] = CachedBlock(b, hb.block_hash, hb.parent_hash, hb.token_ids)
            self.pool.mark_cached(b)
            self._emit(BLOCK_STORED, hb.block_hash, hb.parent_hash, hb.token_ids)

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.queried_tokens += num_queried
        self.hit_tokens += num_hit

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def cached_block(self, block_id: int) -> CachedBlock | None:
        return self._by_block.get(block_id)

    def __len__(self) -> int:
        return len(self._by_hash)

    # ---- store / evict -----------------------------------------------------------------------------------
    def store(self, req: Request) -> None:
        """Register the request's full, computed blocks that are not registered yet.

        A block whose content is already cached under another block id stays private to the request (two
        requests computed the same prefix at once); it goes back to the free list when the request ends.
        """
        # called for every sampled token: the common case (no new full block) returns before any call
        if self.enabled and req.num_computed_tokens // self.block_size > req.num_stored_blocks:
            req.num_stored_blocks = self.store_table(req, req.block_ids, req.num_stored_blocks)

    def store_table(self, req: Request, block_ids: list[int], num_stored: int) -> int:
        """`store` over one table of the request (a sliding group's, kv_groups.py, beside `req.block_ids`) of
        which `num_stored` leading blocks were offered already; returns the new count."""
        bs = self.block_size
        if not self.enabled or req.num_computed_tokens // bs <= num_stored:
            return num_stored
        # min: in overlap mode num_computed counts positions whose token is still being sampled
        n_full = min(min(req.num_computed_tokens, req.num_tokens) // bs, len(block_ids))
        if n_full <= num_stored:
            return num_stored
        hashes = self.block_hashes(req)
        for i in range(num_stored, n_full):
            b = block_ids[i]
            h = hashes[i]
            if (b == 0 and self.pool.null_block) or h in self._by_hash or self.pool.is_cached(b):
                continue
            parent = hashes[i - 1] if i else None
            cb = CachedBlock(b, h, parent, tuple(req.token_slice(i * bs, (i + 1) * bs)))
            self._by_hash[h] = b
            self._by_block[b] = cb
            self.pool.mark_cached(b)
            self._emit(BLOCK_STORED, h, parent, cb.token_ids)
            if self._unwritten is not None:
                self._unwritten.append(h)
        return n_full

    def write_through(self, limit: int) -> int:
        """Write-through: queue the host copies of up to `limit` device blocks cached since the last call, oldest
        first, so that their eviction later costs no copy in the step that evicts them (an admission's, whose
        first token waits for its copies); returns how many were queued. A block evicted meanwhile was copied by
        its eviction, one dropped by a reset is not copied."""
        pending, host = self._unwritten, self.host
        if pending is None or host is None:
            return 0
        n = 0
        while pending and n < limit:
            h = pending.popleft()
            b = self._by_hash.get(h)
            if b is None:
                continue
            cb = self._by_block[b]
            if host.offload(b, h, cb.parent_hash, cb.token_ids):
                n += 1
        return n

    @property
    def num_unwritten(self) -> int:
        """Device blocks cached and not yet written through to the host (0 under write-back)."""
        return len(self._unwritten) if self._unwritten is not None else 0

    def reset(self) -> int:
        """Forget every cached block (blocks held by requests stay theirs); returns how many were dropped."""
        n = len(self._by_hash)
        for b in list(self._by_block):
            if self.pool.refcount(b) > 0:
                self.pool.uncache_owned(b)
                del self._by_hash[self._by_block.pop(b).block_hash]
        listener, self.pool.on_evict = self.pool.on_evict, None  # a clear is one event, not one per block
        try:
            self.pool.evict_all_cached()
        finally:
            self.pool.on_evict = listener
        self._by_hash.clear()
        self._by_block.clear()
        if self.host is not None:  # the host copies go too (not swapped requests'); queued copies still run
            self.host.clear()
        if self._unwritten is not None:
            self._unwritten.clear()
        self._emit(ALL_BLOCKS_CLEARED, None, None, ())
        return n

    def holds(self, block_id: int) -> bool:
        """Whether this cache registered the block (a pool several caches share: window_blocks.py)."""
        return block_id in self._by_block

    def evicted(self, block_id: int) -> None:
        """The pool reclaimed a block this cache registered (its `on_evict`, or a shared pool's dispatch)."""
        self._on_evict(block_id)

    def _on_evict(self, block_id: int) -> None:
        cb = self._by_block.pop(block_id)
        del self._by_hash[cb.block_hash]
        self._emit(BLOCK_REMOVED, cb.block_hash, None, ())
        if self.host is not None:
            self.host.offload(block_id, cb.block_hash, cb.parent_hash, cb.token_ids)

    def _emit_disk(self, kind: str, h: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        if self.on_event is not None:
            self.on_event(kind, h, parent, tokens, medium=DISK_MEDIUM)

    def _emit_host(self, kind: str, h: int, parent: int | None, tokens: tuple[int, ...]) -> None:
        if self.on_event is not None:
            self.on_event(kind, h, parent, tokens, medium=HOST_MEDIUM)

    def _emit(self, kind: str, h: int | None, parent: int | None, tokens: tuple[int, ...]) -> None:
        if self.on_event is not None:
            self.on_event(kind, h, parent, tokens)
