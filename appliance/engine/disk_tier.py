"""The disk tier behind the host tier (cache.disk_cache; pure Python: slots and hashes, the workers move the bytes).

A cached block the host tier drops to reuse its slot is spilled to a disk slot first (SGLang HiCache's storage
tier with its `file` backend, Atlas's high-speed swap). A prefix lookup that runs out of device and host hits goes
on here; a disk hit is fetched into a fresh host slot (kept there as a host block: the tiers are inclusive) and
from there loaded into the device like any host hit. Slots are reused least recently used first.

Copies travel in StepPlan.host_copies with the host tier's: (SPILL, disk slot, host slot) and (FETCH, disk slot,
host slot), run in order with the others (executor/disk_file.py), so a spill reads its host slot before a later
copy rewrites it and a fetch writes its host slot before the load that reads it.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

SPILL, FETCH = 2, 3  # host slot -> disk slot, disk slot -> host slot (after host_tier's STORE, LOAD = 0, 1)
DISK_MEDIUM = "DISK"  # the KV event medium of the disk tier


@dataclass(frozen=True)
class DiskBlock:
    slot: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class DiskTier:
    def __init__(self, num_slots: int,
                 emit: Callable[[str, int, int | None, tuple[int, ...]], None] | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the disk tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._lru: OrderedDict[int, DiskBlock] = OrderedDict()  # by block hash, least recently used first
        self._pinned: set[int] = set()  # hashes an admission is about to fetch: never reused meanwhile
        self.num_spilled = 0
        self.num_fetched = 0
        self._emit = emit

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, block_hash: int) -> DiskBlock | None:
        return self._lru.get(block_hash)

    def spill(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> int | None:
        """The disk slot the host's copy of this block goes to; None if it is on disk already or every slot is
        pinned."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return None
        slot = self._take_slot()
        if slot is None:
            return None
        self._lru[block_hash] = DiskBlock(slot, block_hash, parent_hash, token_ids)
        self.num_spilled += 1
        if self._emit is not None:
            self._emit("BlockStored", block_hash, parent_hash, token_ids)
        return slot

    def pin(self, block_hash: int) -> None:
        self._pinned.add(block_hash)
        self._lru.move_to_end(block_hash)

    def fetched(self, block_hash: int) -> None:
        """A pinned block was fetched into a host slot (its disk copy stays)."""
        self._pinned.discard(block_hash)
        self.num_fetched += 1

    def clear(self) -> None:
        self._free.extend(db.slot for db in self._lru.values())
        self._lru.clear()
        self._pinned.clear()

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        for h, db in self._lru.items():
            if h not in self._pinned:
                del self._lru[h]
                if self._emit is not None:
                    self._emit("BlockRemoved", h, None, ())
                return db.slot
        return None

    def check(self) -> list[str]:
        slots = [db.slot for db in self._lru.values()] + list(self._free)
        problems = []
        if len(set(slots)) != len(slots) or len(slots) != self.num_slots:
            problems.append(f"disk tier: {len(self._lru)} used + {len(self._free)} free slots of {self.num_slots}, "
                            f"{len(slots) - len(set(slots))} twice")
        if self._pinned:
            problems.append(f"disk tier: {len(self._pinned)} blocks still pinned between steps")
        return problems
