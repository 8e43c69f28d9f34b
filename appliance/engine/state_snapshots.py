"""Snapshots of hybrid models' recurrent states at checkpoint boundaries, for prefix reuse (pure Python).

A prefix-cache hit gives the KV of a prefix, but a linear-attention layer also needs its recurrent state at the
prefix's end, which no KV block holds. So during prefill, a chunk that crosses a checkpoint (every
`interval` tokens, a multiple of the block size) ends there, and the workers copy the request's state into a
snapshot slot (ScheduledRequest.save_snapshot), keyed by the chained hash of the prefix's last block (equal
hash = equal prefix, prefix_cache.py). On admission the hit is cut to the deepest checkpoint that has a snapshot,
and the workers copy that snapshot into the request's state (NewRequestData.restore_snapshot); without one the
prefix is recomputed from the start, never reused without its state. Slots are bounded (Atlas's
--ssm-cache-slots); the least recently used snapshot is overwritten first.
"""
from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, num_slots: int, interval: int, block_size: int) -> None:
        if num_slots < 1 or interval < block_size or interval % block_size:
            raise ValueError(f"cache.ssm_checkpoint_interval must be a multiple of cache.block_size ({block_size}) "
                             f"and cache.ssm_cache_slots >= 1; got {interval} tokens, {num_slots} slots")
        self.interval = interval
        self.interval_blocks = interval // block_size
        self._slots: OrderedDict[int, int] = OrderedDict()  # block hash at a checkpoint -> slot, LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self.num_saved = 0
        self.num_restored = 0

    def __len__(self) -> int:
        return len(self._slots)

    def deepest(self, hashes: list[int], hit_blocks: int) -> tuple[int, int]:
        """(blocks, slot) of the deepest checkpoint within the first hit_blocks blocks that has a snapshot, or
        (0, -1)."""
        k = hit_blocks - hit_blocks % self.interval_blocks
        while k > 0:
            slot = self._slots.get(hashes[k - 1])
            if slot is not None:
                self._slots.move_to_end(hashes[k - 1])
                self.num_restored += 1
                return k, slot
            k -= self.interval_blocks
        return 0, -1

    def cut(self, start: int, n: int) -> int:
        """Tokens of a prefill chunk [start, start + n) ending at the last checkpoint inside it, if any."""
        last = (start + n) // self.interval * self.interval
        return last - start if start < last < start + n else n

    def claim(self, block_hash: int) -> int:
        """The slot to save the state at this checkpoint into (-1: a snapshot of it exists already)."""
        if block_hash in self._slots:
            self._slots.move_to_end(block_hash)
            return -1
        slot = self._free.pop() if self._free else self._slots.popitem(last=False)[1]
        self._slots[block_hash] = slot
        self.num_saved += 1
        return slot
