"""The host tier's block copies as a worker issues them: a plan's (direction, device block, host slot) copies
grouped into runs over consecutive host slots, each run issued per cache tensor as few calls as its device blocks
allow.

A run whose device blocks are consecutive too is one copy of the range. A run whose device blocks are scattered is
one contiguous host <-> device copy of the whole slot range through a device staging tensor, plus one gather
(`index_select`, before a store) or scatter (`index_copy_`, after a load) on the device. Why not a copy per
consecutive device block range: each is a separate DMA of a few 32 KiB blocks paying a few microseconds of launch
and PCIe latency, and issuing it from Python costs as much again, while the device-side gather / scatter runs
at memory speed in one kernel; a run then costs two calls per tensor however its device blocks lie. The host
tier (engine/host_tier.py) keeps a request's blocks in consecutive slots in chain order, so the runs are long;
the device blocks a reload lands in need not be.

Within a run the copies are independent (one direction, distinct slots, and for loads distinct blocks), so a
run may be reordered into ascending slots; between runs the plan's order holds (a store out of a block before
the load that reuses it, a load out of a slot before the store that rewrites it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from appliance.engine.host_tier import LOAD, STORE

Pair = tuple[torch.Tensor, torch.Tensor | None]  # one layer's K and V (V None for a one-tensor cache)
MAX_RUN = 1024  # blocks of one run: a scattered run's staging tensor is the transient device memory beside the
# cache (32 MiB per tensor of an 8B model's 16-token blocks)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # an element's bits, by its size


@dataclass(frozen=True)
class HostRun:
    """Copies of one direction between consecutive host slots [slot, slot + n) and the device block of each."""

    direction: int
    slot: int
    blocks: tuple[int, ...]  # in slot order
    consecutive: bool  # the device blocks are consecutive too: one copy of the range

    @property
    def calls(self) -> int:
        """Calls per cache tensor: one copy, or one host copy and one device gather / scatter."""
        return 1 if self.consecutive else 2


def host_runs(copies: list[tuple[int, int, int]], max_len: int = MAX_RUN) -> list[HostRun]:
    """The plan's copies (direction, block, slot) of one kind (STORE / LOAD) as runs of at most max_len over host
    slots that step by +1 or -1, in plan order; a load's run never takes the same device block twice (the later
    must win)."""
    out: list[HostRun] = []
    direction, slots, blocks, step = -1, [0], [0], 0
    taken: set[int] = set()
    for d, block, slot in copies:
        if d not in (STORE, LOAD):  # the disk tier's go to executor/disk_file.py
            raise ValueError(f"host_runs takes device <-> host copies, got direction {d}")
        s = slot - slots[-1]
        if (d == direction and s in ((1, -1) if step == 0 else (step,)) and (d == STORE or block not in taken)
                and len(slots) < max_len):
            slots.append(slot)
            blocks.append(block)
            taken.add(block)
            step = s
            continue
        if direction >= 0:
            out.append(_run(direction, slots, blocks))
        direction, slots, blocks, step, taken = d, [slot], [block], 0, {block}
    if direction >= 0:
        out.append(_run(direction, slots, blocks))
    return out


def _run(direction: int, slots: list[int], blocks: list[int]) -> HostRun:
    if slots[-1] < slots[0]:  # a descending run, turned into ascending slots
        slots, blocks = slots[::-1], blocks[::-1]
    return HostRun(direction, slots[0], tuple(blocks), all(b == blocks[0] + i for i, b in enumerate(blocks)))


@dataclass(frozen=True)
class CopyPlan:
    """Runs ready to issue on a device: the scattered runs' device blocks as one index tensor there, once for
    every layer."""

    runs: tuple[HostRun, ...]
    index: tuple[torch.Tensor | None, ...]  # per run: its device blocks (int64, on the device), None if consecutive

    @classmethod
    def of(cls, copies: list[tuple[int, int, int]], device: torch.device) -> CopyPlan:
        runs = host_runs(copies)
        scattered = [b for r in runs if not r.consecutive for b in r.blocks]
        if not scattered:
            return cls(tuple(runs), (None,) * len(runs))
        flat = torch.tensor(scattered, dtype=torch.int64)
        if device.type == "cuda":  # one small transfer for all the runs and layers, in stream order
            flat = flat.pin_memory().to(device, non_blocking=True)
        index: list[torch.Tensor | None] = []
        at = 0
        for r in runs:
            if r.consecutive:
                index.append(None)
            else:
                index.append(flat[at:at + len(r.blocks)])
                at += len(r.blocks)
        return cls(tuple(runs), tuple(index))

    @property
    def calls_per_tensor(self) -> int:
        return sum(r.calls for r in self.runs)

    def issue(self, dev_pair: Pair, host_pair: Pair) -> None:
        """One cache layer's share, in order, on the current stream (non-blocking to and from pinned memory). The
        caches come as `bits` views: fp8 has no index_copy_ of its own."""
        for run, idx in zip(self.runs, self.index, strict=True):
            n = len(run.blocks)
            for dev, host in zip(dev_pair, host_pair, strict=True):
                if dev is None or host is None:
                    continue
                h = host[run.slot:run.slot + n]
                if idx is None:
                    d = dev[run.blocks[0]:run.blocks[0] + n]
                    (h.copy_(d, non_blocking=True) if run.direction == STORE else d.copy_(h, non_blocking=True))
                    continue
                if run.direction == STORE:  # the staging tensor lives on the copy stream, freed in its order
                    h.copy_(dev.index_select(0, idx), non_blocking=True)
                else:
                    dev.index_copy_(0, idx, h.to(dev.device, non_blocking=True))


def bits(caches: list[Pair]) -> list[Pair]:
    """The caches viewed as integers of their element size: what the copies move, whatever the dtype."""
    return [(k.view(_BITS[k.element_size()]), None if v is None else v.view(_BITS[v.element_size()]))
            for k, v in caches]


def copy_host_blocks(device_caches: list[Pair], host_caches: list[Pair], copies: list[tuple[int, int, int]]) -> None:
    """Run a plan's device <-> host copies in order on the current stream, every layer (the start-up measurement
    of copy rates, executor/swap_cost.py; the runner issues plans through executor/host_copy.py)."""
    if copies and not host_caches:
        raise RuntimeError("the plan carries host-tier copies but this worker has no host tier")
    if not copies:
        return
    plan = CopyPlan.of(copies, device_caches[0][0].device)
    for dev_pair, host_pair in zip(bits(device_caches), bits(host_caches), strict=True):
        plan.issue(dev_pair, host_pair)
