"""What the attention kernels share: the matmul wrapper that dodges the CPU interpreter's bf16 dot bug, the
log2 e factor of their exp2 softmax, and the varlen prefill's map from a query tile to its sequence."""
from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton's interpreter (3.9, CPU) returns garbage for tl.dot on bf16 operands; there we upcast to fp32 first.
# On the GPU the operands go to the tensor cores as they are.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
LOG2E = 1.4426950408889634  # the attention kernels work in exp2 / log2 units: scores are scaled by it once


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
