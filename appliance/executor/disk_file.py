"""The disk tier's bytes on a worker (engine/disk_tier.py): one file under cache.disk_cache_dir per worker process.

Tensor-major: each cache tensor (K then V, layer after layer, as the host tier's caches are listed) owns a region
of num_slots blocks, and disk slot d of that tensor sits at the region's start + d x the tensor's block bytes. A
run of consecutive disk slots is then one contiguous range of every region, as a run of consecutive host slots is
one contiguous range of every host tensor: a plan's spills and fetches are grouped into such runs (`disk_runs`)
and each run moves with one positioned write (spill) or read (fetch) per tensor, straight between the file and
the pinned host tensors' memory (no staging copy). The file is sparse until written and unlinked as soon as it is
open: only its process's descriptor reaches it, and its space is freed when that process ends, however it ends (a
SIGKILL included). The tier is a cache of this run, not a store across restarts.
"""
from __future__ import annotations

import logging
import os
import tempfile
from dataclasses import dataclass

import numpy as np
import torch

from appliance.engine.disk_tier import FETCH, SPILL

Caches = list[tuple[torch.Tensor, torch.Tensor | None]]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DiskRun:
    """One direction's I/O between disk slots [disk_slot, disk_slot + n) and host slots [host_slot, host_slot + n)."""

    direction: int  # SPILL or FETCH
    disk_slot: int
    host_slot: int
    n: int


def disk_runs(ops: list[tuple[int, int, int]]) -> list[DiskRun]:
    """A plan's (direction, disk slot, host slot) ops as runs in plan order: one direction, disk and host slots
    both stepping by +1 (or both by -1, turned ascending). A run's slots are distinct on both sides, so its ops are
    independent and may move together; between runs the plan's order holds (a fetch after a spill of the same
    slot reads the spilled bytes)."""
    out: list[DiskRun] = []
    run: list[tuple[int, int, int]] = []
    step = 0
    for op in ops:
        d, disk_slot, host_slot = op
        if d not in (SPILL, FETCH):
            raise ValueError(f"disk_runs takes spills and fetches, got direction {d}")
        if run and d == run[-1][0]:
            s = disk_slot - run[-1][1]
            if s in ((1, -1) if step == 0 else (step,)) and host_slot - run[-1][2] == s:
                run.append(op)
                step = s
                continue
        if run:
            out.append(_run(run))
        run, step = [op], 0
    if run:
        out.append(_run(run))
    return out


def _run(ops: list[tuple[int, int, int]]) -> DiskRun:
    first = min(ops, key=lambda op: op[1])  # the lowest slots, on both sides
    return DiskRun(first[0], first[1], first[2], len(ops))


class DiskFile:
    def __init__(self, directory: str, host_caches: Caches, num_slots: int) -> None:
        if num_slots < 1 or not host_caches:
            raise ValueError("the disk tier needs slots and the host tier's caches")
        self.tensors = [t for pair in host_caches for t in pair if t is not None]
        if not all(t.is_contiguous() for t in self.tensors):  # a run's bytes are one range of each host tensor
            raise ValueError("the disk tier needs contiguous host caches")
        directory = os.path.expanduser(directory)
        os.makedirs(directory, exist_ok=True)
        self.host_caches = host_caches
        self.num_slots = num_slots
        self.block_bytes = [t[0].numel() * t.element_size() for t in self.tensors]  # one slot of each tensor
        self.slot_bytes = sum(self.block_bytes)
        self.bases = [num_slots * sum(self.block_bytes[:i]) for i in range(len(self.tensors))]  # regions' starts
        self.fd, path = tempfile.mkstemp(prefix="appliance-kv-", suffix=".bin", dir=directory)  # 0600, exclusive
        os.unlink(path)
        try:
            os.ftruncate(self.fd, num_slots * self.slot_bytes)
        except OSError:
            self.close()
            raise
        log.info("disk tier: %d slots of %d bytes (%.1f GiB) in an unlinked file under %s", num_slots,
                 self.slot_bytes, num_slots * self.slot_bytes / (1 << 30), directory)

    def run(self, run: DiskRun) -> None:
        (self.spill if run.direction == SPILL else self.fetch)(run.disk_slot, run.host_slot, run.n)

    def spill(self, disk_slot: int, host_slot: int, n: int = 1) -> None:
        """Host slots [host_slot, host_slot + n) to disk slots [disk_slot, disk_slot + n): one write per tensor."""
        for offset, view in self._ranges(disk_slot, host_slot, n):
            buf = memoryview(view)
            while buf:  # a write may be short (large ranges): go on from where it stopped
                written = os.pwrite(self.fd, buf, offset)
                buf, offset = buf[written:], offset + written

    def fetch(self, disk_slot: int, host_slot: int, n: int = 1) -> None:
        """Disk slots [disk_slot, disk_slot + n) into host slots [host_slot, host_slot + n): one read per tensor."""
        for offset, view in self._ranges(disk_slot, host_slot, n):
            buf = memoryview(view)
            while buf:
                got = os.preadv(self.fd, [buf], offset)
                if got == 0:
                    raise OSError(f"the disk tier's file ended at byte {offset}")
                buf, offset = buf[got:], offset + got

    def _ranges(self, disk_slot: int, host_slot: int, n: int) -> list[tuple[int, np.ndarray]]:
        """Per tensor in file order: the file offset of the disk slots and the host slots' bytes (views: reads land
        in the host tensors)."""
        if n < 1 or not (0 <= disk_slot and disk_slot + n <= self.num_slots):
            raise ValueError(f"disk slots {disk_slot}..{disk_slot + n - 1} outside 0..{self.num_slots - 1}")
        if not (0 <= host_slot and host_slot + n <= self.tensors[0].shape[0]):
            raise ValueError(f"host slots {host_slot}..{host_slot + n - 1} outside the host tier")
        return [(base + disk_slot * size, t[host_slot:host_slot + n].reshape(-1).view(torch.uint8).numpy())
                for t, base, size in zip(self.tensors, self.bases, self.block_bytes, strict=True)]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
