"""What the kernels share: the matmul wrapper that dodges the CPU interpreter's bf16 dot bug, the log2 e factor
of the attention kernels' exp2 softmax, the varlen prefill's map from a query tile to its sequence, and
programmatic dependent launch for the decode step's chain of kernels."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from appliance.kernels.capability import capability

# Triton's interpreter (3.9, CPU) returns garbage for tl.dot on bf16 operands; there we upcast to fp32 first.
# On the GPU the operands go to the tensor cores as they are.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634  # the attention kernels work in exp2 / log2 units: scores are scaled by it once

# Programmatic dependent launch (Hopper and later) inside captured CUDA graphs: a decode step is a chain of ~10
# dependent kernels per layer, most of them a few microseconds long. Launched with it, a kernel's programs start
# while the previous kernel runs and wait (gdc_wait) before touching anything an earlier kernel wrote; the small
# kernels let the next one launch as soon as they start. Eager launches never use it: there it doubled the host
# time of a Qwen3 prefill forward (30 vs 16 ms) for no device gain; docs/kernels.md has the figures.


def pdl_on(t: torch.Tensor) -> bool:
    """Launch the kernels that read `t` with programmatic dependent launch: a CUDA tensor on sm_90 or later,
    while a CUDA graph is being captured."""
    return (not INTERPRET and t.is_cuda and torch.cuda.is_current_stream_capturing()
            and capability(t)[0] >= 9)


def pdl_kwargs(t: torch.Tensor) -> dict[str, bool]:
    """The launch keywords of a kernel taking a GDC constexpr, for a launch that reads `t`: programmatic dependent
    launch where pdl_on says so, a plain launch otherwise (the interpreter knows no launch_pdl option)."""
    return {"GDC": True, "launch_pdl": True} if pdl_on(t) else {"GDC": False}


@triton.jit
def pdl_enter(GDC: tl.constexpr):
    """A short kernel's first step under programmatic dependent launch: let the next kernel launch now (its
    programs wait in turn), then wait until the previous kernel has finished and its writes are visible. Every
    kernel launched with it must pass here before its first load of another kernel's output or its first store."""
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def tile_sequence(tile, cu_tiles_ptr, cu_q_ptr, lens_ptr, num_seqs, LOG_SEQS: tl.constexpr, BLOCK_M: tl.constexpr):
    """The sequence b of a varlen prefill's query tile (binary search: the last b with cu_tiles[b] <= tile) ->
    (b, its first query row, its query length, its sequence length, the tile's first row within it)."""
    lo = num_seqs * 0  # a runtime int32, like hi, so the loop-carried types agree when compiled
    hi = num_seqs
    for _ in range(LOG_SEQS):
        mid = (lo + hi) // 2
        go_right = tl.load(cu_tiles_ptr + mid) <= tile
        lo = tl.where(go_right, mid, lo)
        hi = tl.where(go_right, hi, mid)
    q_start = tl.load(cu_q_ptr + lo)
    q_len = tl.load(cu_q_ptr + lo + 1) - q_start
    return lo, q_start, q_len, tl.load(lens_ptr + lo), (tile - tl.load(cu_tiles_ptr + lo)) * BLOCK_M
