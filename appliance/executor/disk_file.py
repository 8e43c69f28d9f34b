"""The disk tier's bytes on a worker (engine/disk_tier.py): one file under cache.disk_cache_dir per worker process.

Slot-major: disk slot d holds one block of every cache layer (K then V, layer after layer, as the host tier's
slots are laid out per layer), at d x slot_bytes. A spill writes a host slot's layers there, a fetch reads them
back into a host slot; both are plain positioned reads and writes of the pinned host tensors' memory (no staging
copy). The file is sparse until written and unlinked as soon as it is open: only its process's descriptor reaches
it, and its space is freed when that process ends, however it ends (a SIGKILL included). The tier is a cache of
this run, not a store across restarts.
"""
from __future__ import annotations

import logging
import os
import tempfile

import numpy as np
import torch

Caches = list[tuple[torch.Tensor, torch.Tensor | None]]

log = logging.getLogger(__name__)


class DiskFile:
    def __init__(self, directory: str, host_caches: Caches, num_slots: int) -> None:
        if num_slots < 1 or not host_caches:
            raise ValueError("the disk tier needs slots and the host tier's caches")
        directory = os.path.expanduser(directory)
        os.makedirs(directory, exist_ok=True)
        self.host_caches = host_caches
        self.num_slots = num_slots
        self.slot_bytes = sum(t[0].numel() * t.element_size() for pair in host_caches for t in pair if t is not None)
        self.fd, path = tempfile.mkstemp(prefix="appliance-kv-", suffix=".bin", dir=directory)  # 0600, exclusive
        os.unlink(path)
        try:
            os.ftruncate(self.fd, num_slots * self.slot_bytes)
        except OSError:
            self.close()
            raise
        log.info("disk tier: %d slots of %d bytes (%.1f GiB) in an unlinked file under %s", num_slots,
                 self.slot_bytes, num_slots * self.slot_bytes / (1 << 30), directory)

    def _views(self, host_slot: int) -> list[np.ndarray]:
        """The host slot's bytes, tensor by tensor in file order (views: reads land in the host tensors)."""
        return [t[host_slot].reshape(-1).view(torch.uint8).numpy()
                for pair in self.host_caches for t in pair if t is not None]

    def spill(self, disk_slot: int, host_slot: int) -> None:
        offset = self._offset(disk_slot)
        for view in self._views(host_slot):
            buf = memoryview(view)
            while buf:
                n = os.pwrite(self.fd, buf, offset)
                buf, offset = buf[n:], offset + n

    def fetch(self, disk_slot: int, host_slot: int) -> None:
        offset = self._offset(disk_slot)
        for view in self._views(host_slot):
            buf = memoryview(view)
            while buf:
                n = os.preadv(self.fd, [buf], offset)
                if n == 0:
                    raise OSError(f"the disk tier's file ended at byte {offset}")
                buf, offset = buf[n:], offset + n

    def _offset(self, disk_slot: int) -> int:
        if not 0 <= disk_slot < self.num_slots:
            raise ValueError(f"disk slot {disk_slot} outside 0..{self.num_slots - 1}")
        return disk_slot * self.slot_bytes

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
