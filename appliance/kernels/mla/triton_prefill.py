"""MLA prefill in Triton: causal, varlen queries against the paged latent cache (which already holds them).

The kernel works in the absorbed form, like the decode: W_UK is folded into the queries (q_nope @ W_UK, then
q_pe), every head attends to the latent rows directly (MQA of width kv_lora_rank + rope dims) and W_UV is
applied to the latent-space result. The context is never expanded into per-head keys and values, so a long
cached prefix costs no [L, H, dn + dv] temporary; the price is wider dot products than the expanded form
(R + dr = 576 against dn + dr = 192 for DeepSeek), which matters only for long prompts.

Query tiles never straddle sequences; a program finds its sequence by binary search over `cu_tiles` (prefix
sums built on the device), so the grid is an upper bound known on the host and nothing syncs (as in
kernels/triton/prefill.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, LOG2E, mma, tile_sequence
from appliance.kernels.triton.kv_fp8 import kv_fp8_args

BLOCK_M = 16  # query rows per program: the [BLOCK_M, kv_lora_rank] float32 accumulator lives in registers
BLOCK_N = 16 if INTERPRET else 32
NUM_WARPS = 8


@triton.jit
def _mla_prefill_kernel(q_ptr, cache_ptr, bt_ptr, cu_q_ptr, lens_ptr, cu_tiles_ptr, out_ptr, qk_scale, kv_scale_ptr,
                        num_seqs, stride_qt, stride_qh, stride_cb, stride_cs, stride_bt, stride_ot, stride_oh,
                        R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOG_SEQS: tl.constexpr,
                        UPCAST: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    if tile >= tl.load(cu_tiles_ptr + num_seqs):
        return
    b, q_start, q_len, seq_len, m0 = tile_sequence(tile, cu_tiles_ptr, cu_q_ptr, lens_ptr, num_seqs, LOG_SEQS,
                                                   BLOCK_M)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_DR)
    m_mask, r_mask, p_mask = offs_m < q_len, offs_r < R, offs_p < DR
    q_pos = seq_len - q_len + offs_m
    q_row = q_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh
    q_c = tl.load(q_row + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
    q_p = tl.load(q_row + R + offs_p[None, :], mask=m_mask[:, None] & p_mask[None, :], other=0.0)

    if KV_FP8:  # the fp8 latent's one scale: into the softmax scale, and onto the output
        qk_scale = qk_scale * tl.load(kv_scale_ptr)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_R], tl.float32)
    kv_end = tl.minimum(seq_len, seq_len - q_len + m0 + BLOCK_M)  # the tile's last query sees up to here
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        n_mask = pos < kv_end
        blk = tl.load(bt_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        c = tl.load(row[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(row[:, None] + R + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        if KV_FP8:
            c = c.to(q_c.dtype)
            k_pe = k_pe.to(q_c.dtype)
        s = (mma(q_c, tl.trans(c), UPCAST) + mma(q_p, tl.trans(k_pe), UPCAST)) * qk_scale
        s = tl.where(n_mask[None, :] & (pos[None, :] <= q_pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a padding row that sees nothing stays empty
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(c.dtype), c, UPCAST)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(kv_scale_ptr)
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_r[None, :],
             o.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & r_mask[None, :])


@register("mla_prefill", "triton")
def mla_prefill(q: torch.Tensor, cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                block_tables: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float,
                kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    heads, nope, rank = w_uk.shape
    t, bsz = q.shape[0], seq_lens.shape[0]
    if q.shape[1] != heads or q.shape[2] <= nope or cache.shape[-1] != rank + q.shape[2] - nope:
        raise ValueError(f"mla_prefill: q {tuple(q.shape)}, w_uk {tuple(w_uk.shape)} and cache "
                         f"{tuple(cache.shape)} do not fit")
    if cu_seqlens_q.shape != (bsz + 1,) or block_tables.shape[0] != bsz or not cache.is_contiguous():
        raise ValueError("mla_prefill: cu_seqlens_q must be [B+1], block_tables [B, M], the cache contiguous")
    if t == 0 or bsz == 0:
        return q.new_zeros(t, heads, w_uv.shape[1])
    rope = q.shape[2] - nope
    q_lat = torch.einsum("thd,hdr->thr", q[..., :nope], w_uk.to(q.dtype))
    qa = torch.cat((q_lat, q[..., nope:]), dim=-1).contiguous()
    o_lat = torch.empty(t, heads, rank, dtype=q.dtype, device=q.device)
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    cu_tiles = torch.zeros(bsz + 1, dtype=torch.int32, device=q.device)
    cu_tiles[1:] = torch.cumsum(torch.div(q_lens + (BLOCK_M - 1), BLOCK_M, rounding_mode="floor"), 0)
    grid = (triton.cdiv(t, BLOCK_M) + bsz, heads)
    ks, _, fp8 = kv_fp8_args(cache, cache, kv_scale, kv_scale, "mla_prefill")
    _mla_prefill_kernel[grid](qa, cache, block_tables, cu_seqlens_q, seq_lens, cu_tiles, o_lat, scale * LOG2E, ks,
                              bsz,
                              qa.stride(0), qa.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
                              o_lat.stride(0), o_lat.stride(1),
                              R=rank, DR=rope, BLOCK_R=triton.next_power_of_2(rank),
                              BLOCK_DR=max(16, triton.next_power_of_2(rope)), BLOCK_SIZE=cache.shape[1],
                              BLOCK_M=BLOCK_M,
                              BLOCK_N=BLOCK_N, LOG_SEQS=max(1, bsz.bit_length()),
                              UPCAST=INTERPRET or q.dtype == torch.float32, **fp8, num_warps=NUM_WARPS,
                              num_stages=2)
    return torch.einsum("thr,hvr->thv", o_lat, w_uv.to(q.dtype))
