"""What the attention kernels share: the matmul wrapper that dodges the CPU interpreter's bf16 dot bug, the
varlen prefill's map from a query tile to its sequence, and decode's paged KV tile with its online-softmax step."""
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


@triton.jit
def paged_kv_tile(k_ptr, v_ptr, table_row_ptr, pos, n_mask, kvh, stride_cb, stride_cs, stride_ch, offs_d, d_mask,
                  PAGE: tl.constexpr):
    """K and V of one kv head at token positions `pos` (masked by n_mask) of a sequence whose block-table row is
    table_row_ptr: [len(pos), BLOCK_D] each, zeros where masked."""
    blk = tl.load(table_row_ptr + pos // PAGE, mask=n_mask, other=0).to(tl.int64)
    row = blk * stride_cb + (pos % PAGE) * stride_cs + kvh * stride_ch
    kv_mask = n_mask[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def softmax_step(q, k, v, n_mask, m_i, l_i, acc, qk_scale, UPCAST: tl.constexpr):
    """One tile of online softmax (log2 units: qk_scale includes log2 e): the running max, sum and weighted V."""
    s = mma(q, tl.trans(k), UPCAST) * qk_scale
    s = tl.where(n_mask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
    return m_new, l_i, acc
