"""The host-memory tier under the prefix cache (pure Python: slots and hashes; the workers move the bytes).

A full block the device pool evicts from the prefix cache is copied to a host slot instead of being forgotten
(SGLang HiCache's write-on-evict, TokenSpeed's kvstore, Atlas's KV swap). A later prefix lookup that runs out of
device hits continues in the host tier; each host hit gets a fresh device block and is copied back before the
step's forward, then it is an ordinary device prefix-cache block. The host copy stays (the tiers are inclusive),
so a block evicted again needs no second copy. Slots are reused least recently used first.

Slots are kept consecutive along a request's chain, so a worker moves a history in a few copies per layer
(executor/block_copies.py) rather than one per block: the device pool evicts a chain tail first (its release order,
engine/preemption.py), and free slots are handed out from the highest down, so a chain lands in ascending slots in
chain order. The LRU keeps that order too (a hit refreshes its chain tail first), so slots recycled from it come
back as the same descending ranges.

Copies are queued as (direction, device block, host slot) and travel in the next StepPlan (`host_copies`);
workers run them in order before the forward, so a copy out of a block always reads it before that step
rewrites it, and a slot's new content is written after the loads planned before it.

With a disk tier behind it (engine/disk_tier.py), a cached block whose slot is reused is spilled to disk first,
and lookups go on into the disk tier: a disk hit is fetched into a host slot, then loaded like a host hit.

Swapped requests (engine/swap.py) own slots outside the LRU until they resume or end (`take_owned`,
`release_owned`); such slots come from the free ones first, then from the least recently used cached blocks.

KV events: a copy to the host publishes BlockStored with medium "CPU", a slot reused publishes BlockRemoved with
medium "CPU"; a block copied back is stored again on the device (BlockStored without a medium, i.e. GPU).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from appliance.engine.disk_tier import FETCH, SPILL, DiskBlock, DiskTier

STORE, LOAD = 0, 1  # a copy's direction: device block -> host slot, host slot -> device block
WRITE_POLICIES = ("write_back", "write_through")  # cache.host_cache_write_policy: when a block is copied here
# Write-through copies a step carries at most (only a step that loads nothing). They run beside its forward and the
# next step's forward waits for them: kept well under a decode step (on an 8B model's 2 MiB blocks 32 MiB, ~1 ms)
WRITE_THROUGH_BLOCKS = 16
HOST_MEDIUM = "CPU"  # vLLM's KV event medium name of host memory


@dataclass(frozen=True)
class HostBlock:
    slot: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class HostTier:
    def __init__(self, num_slots: int,
                 emit: Callable[[str, int, int | None, tuple[int, ...]], None] | None = None,
                 disk: DiskTier | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))  # taken from the right: the highest first
        self._lru: OrderedDict[int, HostBlock] = OrderedDict()  # by block hash, least recently used first
        self._pinned: set[int] = set()  # hashes an admission is about to load: never reused meanwhile
        self.copies: list[tuple[int, int, int]] = []  # queued for the next plan
        self.num_stored = 0  # blocks copied to the host
        self.num_loaded = 0  # blocks copied back
        self._owned: set[int] = set()  # slots holding swapped requests' blocks (engine/swap.py)
        self.num_swapped_out = 0  # blocks copied out by swaps
        self.num_swapped_in = 0  # blocks copied back by resumes
        self._emit = emit  # the prefix cache's KV event sink, with medium CPU
        self.disk = disk  # the tier behind this one; None without

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, block_hash: int) -> HostBlock | DiskBlock | None:
        """The block in this tier, else in the disk tier behind it."""
        hb = self._lru.get(block_hash)
        if hb is None and self.disk is not None:
            return self.disk.get(block_hash)
        return hb

    def fetchable(self) -> int:
        """Host slots an admission's pin may take: free ones or those of unpinned cached blocks (every pinned
        block is a cached one)."""
        return len(self._free) + len(self._lru) - len(self._pinned)

    def offload(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> bool:
        """Keep a host copy of device block block_id, holding this full block (the device evicts it, or writes it
        through); none if the tier has one. Returns whether a copy was queued."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return False
        slot = self._take_slot()
        if slot is None:
            return False  # every slot is pinned by this admission's loads: the block is dropped, as without a tier
        self._lru[block_hash] = HostBlock(slot, block_hash, parent_hash, token_ids)
        self.copies.append((STORE, block_id, slot))
        self.num_stored += 1
        if self._emit is not None:
            self._emit("BlockStored", block_hash, parent_hash, token_ids)
        return True

    def loading(self) -> bool:
        """Whether the copies queued for the next plan load blocks onto the device (host hits, swap-ins)."""
        return any(c[0] == LOAD for c in self.copies)

    def pin(self, blocks: list[HostBlock | DiskBlock]) -> list[HostBlock]:
        """Keep an admission's hits until they are loaded: host hits pinned first, then disk hits fetched into
        host slots (pinned too); returns the host blocks, in order."""
        host_hits = [hb for hb in blocks if isinstance(hb, HostBlock)]
        disk_hits = [db for db in blocks if isinstance(db, DiskBlock)]
        self._pinned.update(hb.block_hash for hb in host_hits)  # the fetches below must not reuse their slots
        for db in disk_hits:  # a fetch's spill must not reuse the disk slot of another hit (or its own)
            assert self.disk is not None
            self.disk.pin(db.block_hash)
        # the chain refreshed tail first, as the device pool evicts (see above): the fetches land in ascending
        # slots in chain order, and slots recycle from the LRU as ranges
        for db in reversed(disk_hits):
            self._pinned.add(self._fetch(db).block_hash)
        for hb in reversed(host_hits):
            self._lru.move_to_end(hb.block_hash)
        return [self._lru[b.block_hash] for b in blocks]

    def load(self, hb: HostBlock, block_id: int) -> None:
        """Queue the copy of a (pinned) host hit into a fresh device block; unpins it."""
        self._pinned.discard(hb.block_hash)
        self.copies.append((LOAD, block_id, hb.slot))
        self.num_loaded += 1

    def _fetch(self, db: DiskBlock) -> HostBlock:
        assert self.disk is not None
        slot = self._take_slot()
        if slot is None:  # match_host caps disk hits at what fetchable() leaves
            raise AssertionError("no host slot for a disk hit")
        hb = HostBlock(slot, db.block_hash, db.parent_hash, db.token_ids)
        self._lru[db.block_hash] = hb
        self.copies.append((FETCH, db.slot, slot))
        self.disk.fetched(db.block_hash)
        if self._emit is not None:
            self._emit("BlockStored", db.block_hash, db.parent_hash, db.token_ids)
        return hb

    # ---- swapped requests' slots (engine/swap.py) -------------------------------------------------------------
    def take_owned(self, n: int) -> list[int] | None:
        """n slots for a swapped request (free ones, then evicted cached blocks), or None if that many cannot be
        had (pinned and owned slots stay)."""
        if n > self.fetchable():
            return None
        slots = []
        for _ in range(n):
            slot = self._take_slot()
            assert slot is not None
            slots.append(slot)
        slots.sort()  # taken from the highest down: ascending in chain order, like the blocks they copy
        self._owned.update(slots)
        return slots

    def swap_out(self, block_ids: list[int], slots: list[int]) -> None:
        """Queue the copies of a preempted request's blocks into its owned slots."""
        self.copies.extend((STORE, b, s) for b, s in zip(block_ids, slots, strict=True))
        self.num_swapped_out += len(slots)

    def swap_in(self, slots: list[int], block_ids: list[int]) -> None:
        """Queue the copies of a resumed request's owned slots into its fresh device blocks."""
        self.copies.extend((LOAD, b, s) for s, b in zip(slots, block_ids, strict=True))
        self.num_swapped_in += len(slots)

    def release_owned(self, slots: list[int]) -> None:
        """Give a request's slots back (copies already queued from them still run first: the queue is ordered)."""
        for s in slots:
            self._owned.remove(s)
            self._free.append(s)

    def clear(self) -> None:
        """Forget every cached block (a prefix-cache reset); swapped requests keep their slots and queued copies
        still run."""
        self._free.extend(sorted(hb.slot for hb in self._lru.values()))  # the highest taken first again
        self._lru.clear()
        self._pinned.clear()
        if self.disk is not None:
            self.disk.clear()

    def counts(self) -> dict[str, int]:
        """Cumulative block copies by kind, the disk tier's included (the stats' tier_* keys)."""
        disk = self.disk
        return {"tier_host_stored": self.num_stored, "tier_host_loaded": self.num_loaded,
                "tier_swapped_out": self.num_swapped_out, "tier_swapped_in": self.num_swapped_in,
                "tier_disk_spilled": disk.num_spilled if disk is not None else 0,
                "tier_disk_fetched": disk.num_fetched if disk is not None else 0}

    def take_copies(self) -> list[tuple[int, int, int]]:
        out, self.copies = self.copies, []
        return out

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, hb in self._lru.items():
            if h not in self._pinned:
                del self._lru[h]
                disk_slot = self.disk.spill(h, hb.parent_hash, hb.token_ids) if self.disk is not None else None
                if disk_slot is not None:  # queued before whatever rewrites the host slot next
                    self.copies.append((SPILL, disk_slot, hb.slot))
                if self._emit is not None:
                    self._emit("BlockRemoved", h, None, ())
                return hb.slot
        return None

    def check(self, owned: list[int] | None = None) -> list[str]:
        """Every slot is free, holds one cached block or is owned by a swapped request, once; `owned`: the slots
        the live requests hold, which must be exactly the owned ones."""
        used = [hb.slot for hb in self._lru.values()]
        slots = used + list(self._free) + list(self._owned)
        problems = []
        if len(set(slots)) != len(slots) or len(slots) != self.num_slots:
            problems.append(f"host tier: {len(used)} used + {len(self._free)} free + {len(self._owned)} swapped "
                            f"slots of {self.num_slots}, {len(slots) - len(set(slots))} twice")
        if owned is not None and (len(owned) != len(set(owned)) or set(owned) != self._owned):
            problems.append(f"host tier: requests hold swapped slots {sorted(owned)}, the tier {sorted(self._owned)}")
        if self._pinned:
            problems.append(f"host tier: {len(self._pinned)} blocks still pinned between steps")
        return problems + (self.disk.check() if self.disk is not None else [])
