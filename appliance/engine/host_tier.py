"""The host-memory tier under the prefix cache (pure Python: slots and hashes; the workers move the bytes).

A full block the device pool evicts from the prefix cache is copied to a host slot instead of being forgotten
(SGLang HiCache's write-on-evict, TokenSpeed's kvstore, Atlas's KV swap). A later prefix lookup that runs out of
device hits continues in the host tier; each host hit gets a fresh device block and is copied back before the
step's forward, then it is an ordinary device prefix-cache block. The host copy stays (the tiers are inclusive),
so a block evicted again needs no second copy. Slots are reused least recently used first.

Copies are queued as (direction, device block, host slot) and travel in the next StepPlan (`host_copies`);
workers run them in order before the forward, so a copy out of a block always reads it before that step
rewrites it, and a slot's new content is written after the loads planned before it.

KV events: a copy to the host publishes BlockStored with medium "CPU", a slot reused publishes BlockRemoved with
medium "CPU"; a block copied back is stored again on the device (BlockStored without a medium, i.e. GPU).
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

STORE, LOAD = 0, 1  # a copy's direction: device block -> host slot, host slot -> device block
HOST_MEDIUM = "CPU"  # vLLM's KV event medium name of host memory


@dataclass(frozen=True)
class HostBlock:
    slot: int
    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class HostTier:
    def __init__(self, num_slots: int,
                 emit: Callable[[str, int, int | None, tuple[int, ...]], None] | None = None) -> None:
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._lru: OrderedDict[int, HostBlock] = OrderedDict()  # by block hash, least recently used first
        self._pinned: set[int] = set()  # hashes an admission is about to load: never reused meanwhile
        self.copies: list[tuple[int, int, int]] = []  # queued for the next plan
        self.num_stored = 0  # blocks copied to the host
        self.num_loaded = 0  # blocks copied back
        self._emit = emit  # the prefix cache's KV event sink, with medium CPU

    def __len__(self) -> int:
        return len(self._lru)

    def get(self, block_hash: int) -> HostBlock | None:
        return self._lru.get(block_hash)

    def offload(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...]) -> None:
        """The device evicts block_id, holding this full block: keep a host copy (none if it has one)."""
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return
        slot = self._take_slot()
        if slot is None:
            return  # every slot is pinned by this admission's loads: the block is dropped, as without a tier
        self._lru[block_hash] = HostBlock(slot, block_hash, parent_hash, token_ids)
        self.copies.append((STORE, block_id, slot))
        self.num_stored += 1
        if self._emit is not None:
            self._emit("BlockStored", block_hash, parent_hash, token_ids)

    def pin(self, blocks: Iterable[HostBlock]) -> None:
        for hb in blocks:
            self._pinned.add(hb.block_hash)
            self._lru.move_to_end(hb.block_hash)

    def load(self, hb: HostBlock, block_id: int) -> None:
        """Queue the copy of a (pinned) host hit into a fresh device block; unpins it."""
        self._pinned.discard(hb.block_hash)
        self.copies.append((LOAD, block_id, hb.slot))
        self.num_loaded += 1

    def take_copies(self) -> list[tuple[int, int, int]]:
        out, self.copies = self.copies, []
        return out

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.popleft()
        for h, hb in self._lru.items():
            if h not in self._pinned:
                del self._lru[h]
                if self._emit is not None:
                    self._emit("BlockRemoved", h, None, ())
                return hb.slot
        return None

    def check(self) -> list[str]:
        """Every slot is free or holds one block, once."""
        used = [hb.slot for hb in self._lru.values()]
        slots = used + list(self._free)
        problems = []
        if len(set(slots)) != len(slots) or len(slots) != self.num_slots:
            problems.append(f"host tier: {len(used)} used + {len(self._free)} free slots of {self.num_slots}, "
                            f"{len(slots) - len(set(slots))} twice")
        if self._pinned:
            problems.append(f"host tier: {len(self._pinned)} blocks still pinned between steps")
        return problems
