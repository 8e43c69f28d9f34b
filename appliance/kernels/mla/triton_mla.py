"""MLA store and decode in Triton. Decode: absorbed queries against the paged latent cache, one program per (sequence, head tile).

Every head of a sequence reads the same latent rows (MLA is MQA in latent space), so a program serves BLOCK_H
heads and loads each latent tile once: scores = q_c . c + q_pe . k_pe over the kv_lora_rank and rope parts,
an online softmax, and the output accumulated over the latent part c (the caller applies W_UV). The context
length is read on the device (no host sync); a row with seq_len 0 (CUDA-graph padding) writes zeros. An fp8
latent cache (KV_FP8, kernels/triton/kv_fp8.py) is read in q's dtype, its one scale folded into the softmax
scale and the output.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, mma
from appliance.kernels.triton.kv_fp8 import kv_fp8_args, saturate

BLOCK_N = 16 if INTERPRET else 32
BLOCK_H = 16


@triton.jit
def _mla_decode_kernel(q_ptr, cache_ptr, bt_ptr, lens_ptr, out_ptr, scale, kv_scale_ptr, num_heads,
                       stride_qb, stride_qh, stride_cb, stride_cs, stride_bt, stride_ob, stride_oh,
                       R: tl.constexpr, DR: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
                       KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_DR)
    r_mask, p_mask = offs_r < R, offs_p < DR
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
    q_p = tl.load(q_row + R + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0)
    seq_len = tl.load(lens_ptr + b)
    if KV_FP8:
        scale = scale * tl.load(kv_scale_ptr)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(0, seq_len, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < seq_len
        blk = tl.load(bt_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = cache_ptr + blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        c = tl.load(row[:, None] + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0)
        k_pe = tl.load(row[:, None] + R + offs_p[None, :], mask=n_mask[:, None] & p_mask[None, :], other=0.0)
        if KV_FP8:
            c = c.to(q_c.dtype)
            k_pe = k_pe.to(q_c.dtype)
        s = (mma(q_c, tl.trans(c), UPCAST) + mma(q_p, tl.trans(k_pe), UPCAST)) * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + mma(p.to(c.dtype), c, UPCAST)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(kv_scale_ptr)
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_r[None, :], out.to(out_ptr.dtype.element_ty),
             mask=h_mask[:, None] & r_mask[None, :])


@triton.jit
def _store_kernel(latent_ptr, cache_ptr, slots_ptr, kv_scale_ptr, stride_l, WIDTH: tl.constexpr,
                  BLOCK_W: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row)
    if slot < 0:
        return
    offs = tl.arange(0, BLOCK_W)
    mask = offs < WIDTH
    values = tl.load(latent_ptr + row * stride_l + offs, mask=mask)
    if KV_FP8:
        values = saturate(values, tl.load(kv_scale_ptr), FP8_MAX)
    tl.store(cache_ptr + slot * WIDTH + offs, values.to(cache_ptr.dtype.element_ty), mask=mask)


@register("mla_store", "triton")
def mla_store(latent: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor,
              kv_scale: torch.Tensor | None = None) -> None:
    """Each row into its slot (-1: skipped on the device, so no host sync)."""
    if not cache.is_contiguous():
        raise ValueError("the latent cache must be contiguous")
    if latent.shape[0]:
        width = cache.shape[-1]
        latent = latent.contiguous()
        ks, _, fp8 = kv_fp8_args(cache, cache, kv_scale, kv_scale, "mla_store")
        _store_kernel[(latent.shape[0],)](latent, cache, slot_mapping, ks, latent.stride(0), WIDTH=width,
                                          BLOCK_W=triton.next_power_of_2(width), **fp8)


@register("mla_decode", "triton")
def mla_decode(q: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
               scale: float, kv_lora_rank: int, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    batch, heads, width = q.shape
    rope = width - kv_lora_rank
    q = q.contiguous()
    out = torch.empty(batch, heads, kv_lora_rank, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    grid = (batch, triton.cdiv(heads, BLOCK_H))
    ks, _, fp8 = kv_fp8_args(cache, cache, kv_scale, kv_scale, "mla_decode")
    _mla_decode_kernel[grid](q, cache, block_tables, seq_lens, out, scale, ks, heads,
                             q.stride(0), q.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
                             out.stride(0), out.stride(1),
                             R=kv_lora_rank, DR=rope, BLOCK_R=triton.next_power_of_2(kv_lora_rank),
                             BLOCK_DR=max(16, triton.next_power_of_2(rope)), BLOCK_H=BLOCK_H, BLOCK_SIZE=cache.shape[1],
                             BLOCK_N=BLOCK_N, UPCAST=INTERPRET or q.dtype == torch.float32, **fp8)
    return out
