"""The host tier's block copies (engine/host_tier.py) beside the forward.

On a GPU a plan's copies run on a side stream, layer by layer, each layer's copies closed by an event. The side
stream first waits for everything the compute stream was given before (a store then reads a block after the
steps in flight wrote it; a load's block is no longer read by them). The step's forward waits for layer i's
event just before layer i first touches its cache (`kv_ready` of the attention layers), so layer i's copies run
while the layers before it compute; a forward run as piecewise graph pieces waits the same way before the piece
that stores into layer i (executor/piecewise.py `replay`); one replayed from a decode graph (whose cache accesses
are all captured) or running layers without the hook waits for the last event before it starts.
Write-through stores (StepPlan.host_writes, the plan's last copies) are issued after the others and waited for by
the next step's forward instead: no forward rewrites their blocks before a later step reuses them.
Either way the wait is one stream waiting on an event: the host never waits, and no device-wide sync happens.
On the CPU the copies run synchronously in the same order (`Inline`), so the same interface is exercised.

The disk tier's copies (engine/disk_tier.py: spills of host slots, fetches into them) are file I/O on the host
(executor/disk_file.py: runs of consecutive disk and host slots, one write or read per tensor per run), run where
they stand in the plan's order: before them, the host waits for the copy stream's work so far (`drain`: that
stream only, which also waited for the steps launched before it), so a spill reads a host slot after the stores
into it and a fetch writes one after the loads from it. A plan with disk copies therefore holds the host until the
step before it has run.
"""
from __future__ import annotations

import contextlib
import weakref
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from appliance.engine.config import disk_blocks, host_blocks
from appliance.engine.disk_tier import FETCH, SPILL
from appliance.executor import kv_cache
from appliance.executor.block_copies import CopyPlan, bits
from appliance.executor.disk_file import DiskFile, disk_runs
from appliance.executor.kv_cache import KVCacheSpec

if TYPE_CHECKING:
    from appliance.config.sections_engine import CacheSection

Caches = list[tuple[torch.Tensor, torch.Tensor | None]]


class CopyStream(Protocol):
    """Where the copies run and how the compute stream waits for them."""

    def begin(self) -> None:
        """The copies issued after this see all work issued to the compute stream before it."""

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """Copies issued inside run on the copy stream."""

    def mark(self) -> object | None:
        """A marker after the copies issued so far (None: they are done already)."""

    def wait(self, mark: object) -> None:
        """The compute stream waits for the marker (never the host)."""

    def drain(self) -> None:
        """The host waits for the copies issued so far (before disk I/O on the host slots)."""


class Inline:
    """The CPU: copies run at once, in order; nothing to wait for."""

    def begin(self) -> None:
        pass

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def mark(self) -> object | None:
        return None

    def wait(self, mark: object) -> None:
        pass

    def drain(self) -> None:
        pass


class SideStream:
    """A CUDA side stream; markers are CUDA events."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def begin(self) -> None:
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(self.stream)

    def mark(self) -> object | None:
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, mark: object) -> None:
        assert isinstance(mark, torch.cuda.Event)
        torch.cuda.current_stream(self.device).wait_event(mark)

    def drain(self) -> None:
        self.stream.synchronize()


class HostCopier:
    """Runs plans' (direction, block, slot) copies between the device caches and the host tier's slots."""

    def __init__(self, device_caches: Caches, host_caches: Caches, stream: CopyStream,
                 disk: DiskFile | None = None) -> None:
        self.device_caches, self.host_caches, self.stream, self.disk = device_caches, host_caches, stream, disk
        # what the copies move (none without a tier)
        self._bits = list(zip(bits(device_caches), bits(host_caches), strict=True)) if host_caches else []
        self._marks: list[object | None] = [None] * len(device_caches)  # per cache layer, not yet waited for
        self._carried: list[object | None] = [None] * len(device_caches)  # write-through's: the next step waits
        self.layerwise = False  # every cache layer's attention calls its kv_ready hook (bind_layers)

    @classmethod
    def for_device(cls, device_caches: Caches, host_caches: Caches, device: torch.device,
                   disk: DiskFile | None = None) -> HostCopier:
        stream: CopyStream = SideStream(device) if device.type == "cuda" and host_caches else Inline()
        return cls(device_caches, host_caches, stream, disk)

    @classmethod
    def build(cls, cache: CacheSection, spec: KVCacheSpec, num_blocks: int, device_caches: Caches,
              device: torch.device) -> HostCopier:
        """The tiers a worker's config asks for: host slots as many as the scheduler's (engine/config.py
        host_blocks), a disk file of disk_blocks slots behind them, closed with the copier."""
        num_host = host_blocks(cache, num_blocks, spec.bytes_per_block)
        host_caches = kv_cache.allocate_host(spec, num_host, device)
        num_disk = disk_blocks(cache, spec.bytes_per_block) if num_host else 0
        disk = DiskFile(str(cache.disk_cache_dir), host_caches, num_disk) if num_disk else None
        copier = cls.for_device(device_caches, host_caches, device, disk)
        if disk is not None:
            weakref.finalize(copier, disk.close)
        return copier

    @property
    def num_host_slots(self) -> int:
        return self.host_caches[0][0].shape[0] if self.host_caches else 0

    @property
    def num_disk_slots(self) -> int:
        return self.disk.num_slots if self.disk is not None else 0

    def bind_layers(self, layers: list[Any]) -> None:
        """Give each cache layer's attention its wait (layer i of `layers` owns device_caches[i]); layer-by-layer
        waits only when every layer takes the hook, else the forward waits for all copies first."""
        hooked = all(hasattr(layer, "kv_ready") for layer in layers) and len(layers) == len(self.device_caches)
        for i, layer in enumerate(layers):
            if hasattr(layer, "kv_ready"):
                layer.kv_ready = partial(self.wait_layer, i) if hooked else None
        self.layerwise = hooked

    def submit(self, copies: list[tuple[int, int, int]], writes: int = 0) -> None:
        """Issue a plan's copies, layer by layer, in the plan's order within each layer: a few calls per run of
        consecutive host slots (executor/block_copies.py), never one per block. The last `writes` are write-through
        stores (StepPlan.host_writes), issued after the others and waited for by the next step's forward, not this
        one's; the previous plan's are waited for by this step's."""
        for i, mark in enumerate(self._carried):
            if mark is not None and self._marks[i] is None:
                self._marks[i] = mark
        self._carried = [None] * len(self._carried)
        if not copies:
            return
        if not self.host_caches:
            raise RuntimeError("the plan carries host-tier copies but this worker has no host tier")
        self.stream.begin()
        split = len(copies) - writes
        self._issue(copies[:split], self._marks)
        self._issue(copies[split:], self._carried)

    def _issue(self, copies: list[tuple[int, int, int]], marks: list[object | None]) -> None:
        for on_disk, ops in segments(copies):
            if on_disk:
                self._disk_io(ops)
                continue
            with self.stream.scope():  # the index tensor goes on the copy stream too, before the copies that read it
                plan = CopyPlan.of(ops, self.device_caches[0][0].device)
                for i, (dev_pair, host_pair) in enumerate(self._bits):
                    plan.issue(dev_pair, host_pair)
                    marks[i] = self.stream.mark()

    def _disk_io(self, ops: list[tuple[int, int, int]]) -> None:
        if self.disk is None:
            raise RuntimeError("the plan carries disk-tier copies but this worker has no disk tier")
        self.stream.drain()
        for run in disk_runs(ops):  # one write or read per tensor per run of consecutive slots
            self.disk.run(run)

    def wait_layer(self, layer: int) -> None:
        """The compute stream waits for this layer's copies (a no-op once waited, or without copies)."""
        mark = self._marks[layer]
        if mark is not None:
            self._marks[layer] = None
            self.stream.wait(mark)

    def wait_all(self) -> None:
        """The compute stream waits for every copy issued (the last layer's marker closes them all)."""
        last = self._marks[-1] if self._marks else None
        self._marks = [None] * len(self._marks)
        if last is not None:
            self.stream.wait(last)


def segments(copies: list[tuple[int, int, int]]) -> list[tuple[bool, list[tuple[int, int, int]]]]:
    """The plan's copies cut into runs of device <-> host copies and of disk I/O (True), in order."""
    out: list[tuple[bool, list[tuple[int, int, int]]]] = []
    for c in copies:
        on_disk = c[0] in (SPILL, FETCH)
        if out and out[-1][0] == on_disk:
            out[-1][1].append(c)
        else:
            out.append((on_disk, [c]))
    return out
