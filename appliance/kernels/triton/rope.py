"""Rotary position embedding for q and k from a precomputed cos/sin cache.

The cache rows are cat(cos, sin) over rot_dim/2 each; llama3 and YaRN scaling live in how the model builds the
cache, so one kernel serves them all. Dims past rot_dim (partial rotary) pass through unchanged.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.registry import register


@triton.jit
def rotary_pairs(BLOCK_HALF: tl.constexpr, HALF: tl.constexpr, IS_NEOX: tl.constexpr):
    """[1, BLOCK_HALF] pair index i and where its two elements sit in a head: the two halves (neox) or
    neighbours (GPT-J, interleaved pairs)."""
    offs_i = tl.arange(0, BLOCK_HALF)[None, :]
    if IS_NEOX:
        i1 = offs_i
        i2 = offs_i + HALF
    else:
        i1 = 2 * offs_i
        i2 = 2 * offs_i + 1
    return offs_i, i1, i2


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, stride_st, stride_sh, stride_dt, stride_dh, t, n_heads, cos, sin,
                  HALF: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  BLOCK_D: tl.constexpr, IS_NEOX: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_i, i1, i2 = rotary_pairs(BLOCK_HALF, HALF, IS_NEOX)
    h_mask = offs_h < n_heads
    mask = h_mask & (offs_i < HALF)
    src = src_ptr + t * stride_st + offs_h * stride_sh
    dst = dst_ptr + t * stride_dt + offs_h * stride_dh
    x1 = tl.load(src + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=mask, other=0.0).to(tl.float32)
    ty = dst_ptr.dtype.element_ty
    tl.store(dst + i1, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + i2, (x2 * cos + x1 * sin).to(ty), mask=mask)
    if 2 * HALF < D:  # partial rotary: copy the tail
        offs_p = 2 * HALF + tl.arange(0, BLOCK_D)[None, :]
        p_mask = h_mask & (offs_p < D)
        tl.store(dst + offs_p, tl.load(src + offs_p, mask=p_mask), mask=p_mask)


@triton.jit
def _rope_kernel(pos_ptr, q_ptr, k_ptr, cache_ptr, qo_ptr, ko_ptr,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                 stride_c, n_q, n_k,
                 HALF: tl.constexpr, D: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, IS_NEOX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)[None, :]
    c_mask = offs_i < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_i, mask=c_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_i, mask=c_mask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, qo_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, t, n_q, cos, sin,
                  HALF, D, BLOCK_QH, BLOCK_HALF, BLOCK_D, IS_NEOX)
    _rotate_heads(k_ptr, ko_ptr, stride_kt, stride_kh, stride_kot, stride_koh, t, n_k, cos, sin,
                  HALF, D, BLOCK_KH, BLOCK_HALF, BLOCK_D, IS_NEOX)


@register("rope", "triton")
def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
         is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    t, hq, d = q.shape
    rot = cos_sin_cache.shape[-1]
    if k.shape[0] != t or k.shape[2] != d or positions.shape != (t,):
        raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)}, positions {tuple(positions.shape)} disagree")
    if rot % 2 or rot > d:
        raise ValueError(f"rope: cache width {rot} must be even and <= head_dim {d}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rope: the last axis of q, k and the cache must be contiguous")
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if t == 0:
        return q_out, k_out
    half = rot // 2
    _rope_kernel[(t,)](
        positions, q, k, cos_sin_cache, q_out, k_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin_cache.stride(0), hq, k.shape[1],
        HALF=half, D=d, BLOCK_QH=triton.next_power_of_2(hq), BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_D=triton.next_power_of_2(max(1, d - rot)),
        IS_NEOX=is_neox, num_warps=4,
    )
    return q_out, k_out
