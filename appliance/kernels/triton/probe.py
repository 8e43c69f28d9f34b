"""A lab probe inside kernels: when each program started, waited, streamed and ended.

Setting TIMELINE before the decode chain is captured turns it on. Each chain GEMV launch
then takes the next row of the buffer, and every program writes FIELDS int64 values: %globaltimer (ns, 32 ns
steps on the H100) as it starts, when its wait for the kernel before returns, when its weight stream is done and
as it ends; its SM (%smid); its clock cycles over the stream. With TIMELINE None the kernels compile without it
(PROBE is a constexpr), so served graphs carry none of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FIELDS = tl.constexpr(6)


class Timeline:
    """FIELDS int64 per program, one row per probed launch, named in `launches`."""

    def __init__(self, launches: int, programs: int, device: torch.device | str) -> None:
        self.buf = torch.zeros(launches, programs, FIELDS, dtype=torch.int64, device=device)
        self.launches: list[tuple[str, int]] = []

    def take(self, name: str, programs: int) -> torch.Tensor:
        if len(self.launches) == self.buf.shape[0] or programs > self.buf.shape[1]:
            raise ValueError(f"timeline: no room for launch {len(self.launches)} of {programs} programs")
        self.launches.append((name, programs))
        return self.buf[len(self.launches) - 1]


TIMELINE: Timeline | None = None


def launch_kwargs(name: str, programs: int, like: torch.Tensor) -> dict[str, object]:
    """A probed kernel's probe_ptr and PROBE: the next row of TIMELINE, or off (`like`: any tensor argument)."""
    if TIMELINE is None:
        return {"probe_ptr": like, "PROBE": False}
    return {"probe_ptr": TIMELINE.take(name, programs), "PROBE": True}


@triton.jit
def _read(pid, ASM: tl.constexpr, PROBE: tl.constexpr):
    """The 64-bit register ASM moves into $0 where the probe is compiled in, else 0."""
    t = pid.to(tl.int64) * 0
    if PROBE:
        t = tl.inline_asm_elementwise(ASM, "=l,r", [pid], dtype=tl.int64, is_pure=False, pack=1)
    return t


@triton.jit
def now(pid, PROBE: tl.constexpr):
    """%globaltimer, ns."""
    return _read(pid, "mov.u64 $0, %globaltimer;", PROBE)


@triton.jit
def cycles(pid, PROBE: tl.constexpr):
    """%clock64 of this SM."""
    return _read(pid, "mov.u64 $0, %clock64;", PROBE)


@triton.jit
def write(probe_ptr, pid, t0, t1, t2, c1, c2, PROBE: tl.constexpr):
    """Program pid's row: t0..t2 and now, its SM, c2 - c1."""
    if PROBE:
        t3 = now(pid, PROBE)
        sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [pid], dtype=tl.int32, is_pure=False, pack=1)
        row = probe_ptr + pid * FIELDS
        tl.store(row, t0)
        tl.store(row + 1, t1)
        tl.store(row + 2, t2)
        tl.store(row + 3, t3)
        tl.store(row + 4, sm.to(tl.int64))
        tl.store(row + 5, c2 - c1)
