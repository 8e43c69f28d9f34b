"""Prefill / extend attention: causal, varlen queries over a paged KV cache that already holds the new tokens.

Query tiles never straddle sequences. A sliding window (`sliding_window`) starts each tile's key loop at the
first key its first row sees and masks every tile; sinks (`sinks`) join each row's softmax denominator at the end.
Which sequence a program serves comes from `cu_tiles` (a prefix sum of
tiles per sequence, built with torch ops on the device, once per step: kernels/step_cache.py) by binary search in
the kernel, so the grid size is an upper bound known on the host (T / BLOCK_M + B) and nothing syncs.
A draft tree's mask (`tree_mask` [T] int64 bits per query row over its sequence's last `tree_width` [B] keys;
kernels/reference/attention.py states it) masks every tile from the one holding the tree's first key.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.reference.attention import attention_out
from appliance.kernels.registry import register
from appliance.kernels.step_cache import StepCache
from appliance.kernels.triton.common import INTERPRET, LOG2E, mma, tile_sequence
from appliance.kernels.triton.kv_fp8 import kv_fp8_args

BLOCK_M = 64
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2
_TILES = StepCache()  # the step's cu_tiles: the same for every layer (~6 small ops saved per layer)


@triton.jit
def _kv_tile(q, k_ptr, v_ptr, bt_ptr, kv_row, kvh, stride_cb, stride_cs, stride_ch, n0, kv_end, q_pos,
             m_i, l_i, acc, qk_scale, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             BLOCK_N: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr, KV_FP8: tl.constexpr, window=0,
             WINDOW: tl.constexpr = False, tree_lo=0, tree_bits=None, TREE: tl.constexpr = False):
    """One online-softmax step over kv positions n0 .. n0 + BLOCK_N; MASKED applies the causal and end masks (and
    the window's, with WINDOW; the tree's, with TREE: keys from tree_lo on need their bit in the row's
    tree_bits). An fp8 tile is read in q's dtype (its k scale is in qk_scale, its v scale applied to the
    output)."""
    pos = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    if MASKED:
        n_mask = pos < kv_end
        blk = tl.load(bt_ptr + kv_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        kv_mask = n_mask[:, None] & d_mask[None, :]
    else:
        blk = tl.load(bt_ptr + kv_row + pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = (pos >= 0)[:, None] & d_mask[None, :]
    row = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
    if MASKED or BLOCK_D != D:
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    else:
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :])
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :])
    if KV_FP8:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = mma(q, tl.trans(k), UPCAST) * qk_scale
    if MASKED:
        keep = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        if WINDOW:
            keep = keep & (pos[None, :] > q_pos[:, None] - window)
        if TREE:
            index = pos - tree_lo
            bit = (tree_bits[:, None] >> tl.maximum(index, 0).to(tl.int64)[None, :]) & 1
            keep = keep & ((index < 0)[None, :] | (bit != 0))
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet stays empty
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_q_ptr, lens_ptr, bt_ptr, cu_tiles_ptr, qk_scale,
                    k_scale_ptr, v_scale_ptr,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_cb, stride_cs, stride_ch, stride_bt, num_seqs,
                    GROUP: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOG_SEQS: tl.constexpr, UPCAST: tl.constexpr,
                    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, window=0, sinks_ptr=None,
                    WINDOW: tl.constexpr = False, SINKS: tl.constexpr = False, tree_mask_ptr=None,
                    tree_width_ptr=None, TREE: tl.constexpr = False):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    total_tiles = tl.load(cu_tiles_ptr + num_seqs)
    if tile >= total_tiles:
        return
    b, q_start, q_len, seq_len, m0 = tile_sequence(tile, cu_tiles_ptr, cu_q_ptr, lens_ptr, num_seqs, LOG_SEQS,
                                                   BLOCK_M)
    kvh = head // GROUP

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < D
    q_pos = seq_len - q_len + offs_m
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:
        qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)
    tree_lo = seq_len
    tree_bits = tl.zeros([BLOCK_M], tl.int64)
    if TREE:
        tree_lo = seq_len - tl.load(tree_width_ptr + b)
        tree_bits = tl.load(tree_mask_ptr + q_start + offs_m, mask=m_mask, other=0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_row = b * stride_bt
    # kv tiles wholly at or before the tile's first query position are visible to every row: no masks there
    full_end = ((seq_len - q_len + m0 + 1) // BLOCK_N) * BLOCK_N
    kv_end = tl.minimum(seq_len, seq_len - q_len + m0 + BLOCK_M)  # last query row of the tile sees up to here
    if WINDOW:  # from the tile that holds the first row's first visible key, every tile masked
        first = tl.maximum(seq_len - q_len + m0 - window + 1, 0)
        full_end = (first // BLOCK_N) * BLOCK_N
    else:
        if TREE:  # the tree's keys may lie before the tile's first query position (a drafter's tree steps)
            full_end = tl.minimum(full_end, (tree_lo // BLOCK_N) * BLOCK_N)
        for n0 in range(0, full_end, BLOCK_N):
            m_i, l_i, acc = _kv_tile(q, k_ptr, v_ptr, bt_ptr, kv_row, kvh, stride_cb, stride_cs, stride_ch, n0,
                                     kv_end, q_pos, m_i, l_i, acc, qk_scale, D, BLOCK_D, BLOCK_SIZE, BLOCK_N, False,
                                     UPCAST, KV_FP8)
    for n0 in range(full_end, kv_end, BLOCK_N):
        m_i, l_i, acc = _kv_tile(q, k_ptr, v_ptr, bt_ptr, kv_row, kvh, stride_cb, stride_cs, stride_ch, n0, kv_end,
                                 q_pos, m_i, l_i, acc, qk_scale, D, BLOCK_D, BLOCK_SIZE, BLOCK_N, True, UPCAST, KV_FP8,
                                 window, WINDOW, tree_lo, tree_bits, TREE)
    if SINKS:  # the sink joins the denominator only
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]

    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kvh)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def _cu_tiles(cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """[B+1] int32: the first query tile of each sequence (a prefix sum of ceil(q_len / BLOCK_M))."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    cu_tiles = torch.zeros(cu_seqlens_q.shape[0], dtype=torch.int32, device=cu_seqlens_q.device)
    cu_tiles[1:] = torch.cumsum(torch.div(q_lens + (BLOCK_M - 1), BLOCK_M, rounding_mode="floor"), 0)
    return cu_tiles


@register("prefill_attention", "triton")
def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, sliding_window: int | None = None,
                      sinks: torch.Tensor | None = None, tree_mask: torch.Tensor | None = None,
                      tree_width: torch.Tensor | None = None) -> torch.Tensor:
    t, h, d = q.shape
    _, block_size, hkv, dk = k_cache.shape
    bsz = seq_lens.shape[0]
    if dk != d or h % hkv or v_cache.shape != k_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"prefill_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if cu_seqlens_q.shape != (bsz + 1,) or block_tables.shape[0] != bsz:
        raise ValueError("prefill_attention: cu_seqlens_q must be [B+1] and block_tables [B, M] for B = len(seq_lens)")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("prefill_attention: the head_dim axis must be contiguous")
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"prefill_attention: sinks {tuple(sinks.shape)} is not [{h}]")
    if (tree_mask is None) != (tree_width is None) or (tree_mask is not None and (
            tree_mask.shape != (t,) or tree_mask.dtype != torch.int64 or tree_width.shape != (bsz,))):
        raise ValueError("prefill_attention: a tree mask is tree_mask [T] int64 with tree_width [B]")
    out = attention_out("prefill_attention", q, out)
    if t == 0 or bsz == 0:
        return out
    ks, vs, fp8 = kv_fp8_args(k_cache, v_cache, k_scale, v_scale, "prefill_attention")
    cu_tiles = _TILES.get((cu_seqlens_q,), BLOCK_M, lambda: _cu_tiles(cu_seqlens_q))
    max_tiles = triton.cdiv(t, BLOCK_M) + bsz
    _prefill_kernel[(max_tiles, h)](
        q, k_cache, v_cache, out, cu_seqlens_q, seq_lens, block_tables, cu_tiles, scale * LOG2E, ks, vs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), bsz,
        GROUP=h // hkv, D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_SIZE=block_size,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, LOG_SEQS=max(1, (bsz).bit_length()),
        UPCAST=INTERPRET, **fp8, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        **({} if sliding_window is None else {"window": int(sliding_window), "WINDOW": True}),
        **({} if sinks is None else {"sinks_ptr": sinks, "SINKS": True}),
        **({} if tree_mask is None else {"tree_mask_ptr": tree_mask, "tree_width_ptr": tree_width, "TREE": True}),
    )
    return out
