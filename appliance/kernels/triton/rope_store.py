"""The attention prologue in one launch: read q/k/v from the qkv GEMM output, RMSNorm each q and k head
(Qwen3; optional), rotate q and k, write q contiguous and scatter k and v into the paged cache.

Replaces up to six small kernels per layer (two copies, q_norm, k_norm, rope, store_kv). Rounding follows the
reference chain step by step: the normed value is rounded to the input dtype before the weight multiply, the
weighted value to the output dtype, the rotation is computed in float32 and rounded once, and k is rounded to
the output dtype before the cache's. fp16 under the interpreter matches the reference bit for bit; bf16 differs
only where float32 rsqrt / fma differ (on a GPU) or where the interpreter truncates float32 -> bf16.

Grid: (rows, q head blocks + kv head blocks). A program either norms and rotates a block of q heads, or norms,
rotates and stores a block of k heads together with the same v heads (nothing for a padding row, slot < 0).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.reference.rope_store import check_rope_store_args
from appliance.kernels.registry import register
from appliance.kernels.triton.common import pdl_enter, pdl_kwargs
from appliance.kernels.triton.kv_fp8 import kv_fp8_args, saturate
from appliance.kernels.triton.rope import rotary_pairs

MAX_BLOCK_ELEMS = 2048  # heads x half-dim per program: bounds registers for wide models


@triton.jit
def _norm_rope_heads(src, w_ptr, out_ptr, h_mask, cos, sin, eps, HALF: tl.constexpr, D: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, IS_NEOX: tl.constexpr,
                     HAS_NORM: tl.constexpr):
    """src: [BLOCK_H, 1] pointers to each head's first element; out_ptr only names the output dtype. Returns
    the rotated halves and the unrotated tail in that dtype, and where in a head they go."""
    IN_TY = src.dtype.element_ty
    OUT_TY = out_ptr.dtype.element_ty
    offs_i, i1, i2 = rotary_pairs(BLOCK_HALF, HALF, IS_NEOX)
    mask = h_mask & (offs_i < HALF)
    offs_p = 2 * HALF + tl.arange(0, BLOCK_TAIL)[None, :]
    p_mask = h_mask & (offs_p < D)
    x1 = tl.load(src + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + i2, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(src + offs_p, mask=p_mask, other=0.0).to(tl.float32)
    if HAS_NORM:
        ss = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xp * xp, 1)
        inv = tl.rsqrt(ss / D + eps)[:, None]
        w1 = tl.load(w_ptr + i1, mask=offs_i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + i2, mask=offs_i < HALF, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + offs_p, mask=offs_p < D, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * inv).to(IN_TY).to(tl.float32)).to(OUT_TY).to(tl.float32)
        x2 = (w2 * (x2 * inv).to(IN_TY).to(tl.float32)).to(OUT_TY).to(tl.float32)
        xp = (wp * (xp * inv).to(IN_TY).to(tl.float32)).to(OUT_TY).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(OUT_TY)
    y2 = (x2 * cos + x1 * sin).to(OUT_TY)
    return y1, y2, xp.to(OUT_TY), i1, i2, offs_p, mask, p_mask


@triton.jit
def _q_heads(row, w_ptr, q_row, h0, cos, sin, eps, NQ: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
             BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, IS_NEOX: tl.constexpr,
             HAS_NORM: tl.constexpr):
    h = h0 + tl.arange(0, BLOCK_H)[:, None]
    y1, y2, yp, i1, i2, offs_p, mask, p_mask = _norm_rope_heads(
        row + h * D, w_ptr, q_row, h < NQ, cos, sin, eps, HALF, D, BLOCK_HALF, BLOCK_TAIL, IS_NEOX, HAS_NORM)
    dst = q_row + h * D
    tl.store(dst + i1, y1, mask=mask)
    tl.store(dst + i2, y2, mask=mask)
    if 2 * HALF < D:
        tl.store(dst + offs_p, yp, mask=p_mask)


@triton.jit
def _kv_heads(row, w_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_off, stride_ch, h0,
              cos, sin, eps, NQ: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
              BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr,
              IS_NEOX: tl.constexpr, HAS_NORM: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    """k normed, rotated and rounded like q (q_ptr names that dtype), then to the cache's; v copied as is (an fp8
    cache: both divided by their head's scale and saturated)."""
    cache_ty = k_cache_ptr.dtype.element_ty
    h = h0 + tl.arange(0, BLOCK_H)[:, None]
    h_mask = h < NKV
    y1, y2, yp, i1, i2, offs_p, mask, p_mask = _norm_rope_heads(
        row + NQ * D + h * D, w_ptr, q_ptr, h_mask, cos, sin, eps, HALF, D, BLOCK_HALF, BLOCK_TAIL, IS_NEOX,
        HAS_NORM)
    if KV_FP8:
        ks = tl.load(k_scale_ptr + h, mask=h_mask, other=1.0)
        y1, y2, yp = saturate(y1, ks, FP8_MAX), saturate(y2, ks, FP8_MAX), saturate(yp, ks, FP8_MAX)
    dst = slot_off + h * stride_ch
    tl.store(k_cache_ptr + dst + i1, y1.to(cache_ty), mask=mask)
    tl.store(k_cache_ptr + dst + i2, y2.to(cache_ty), mask=mask)
    if 2 * HALF < D:
        tl.store(k_cache_ptr + dst + offs_p, yp.to(cache_ty), mask=p_mask)
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    d_mask = h_mask & (offs_d < D)
    v = tl.load(row + (NQ + NKV) * D + h * D + offs_d, mask=d_mask)
    if KV_FP8:
        v = saturate(v, tl.load(v_scale_ptr + h, mask=h_mask, other=1.0), FP8_MAX)
    tl.store(v_cache_ptr + dst + offs_d, v.to(cache_ty), mask=d_mask)


@triton.jit
def _rope_store_kernel(pos_ptr, qkv_ptr, cache_ptr, qw_ptr, kw_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                       k_scale_ptr, v_scale_ptr, stride_x, stride_c, stride_qt, stride_cb, stride_cs, stride_ch, eps,
                       NQ: tl.constexpr, NKV: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                       BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr, IS_NEOX: tl.constexpr,
                       HAS_NORM: tl.constexpr, GDC: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    pdl_enter(GDC)
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    nqb = (NQ + BLOCK_H - 1) // BLOCK_H
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)[None, :]
    c_mask = offs_i < HALF
    cos = tl.load(cache_ptr + pos * stride_c + offs_i, mask=c_mask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + offs_i, mask=c_mask, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_x
    if hb < nqb:  # a block of q heads
        _q_heads(row, qw_ptr, q_ptr + t * stride_qt, hb * BLOCK_H, cos, sin, eps, NQ, HALF, D, BLOCK_H,
                 BLOCK_HALF, BLOCK_TAIL, IS_NEOX, HAS_NORM)
    else:  # a block of kv heads; padding rows (slot < 0) store nothing
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            slot_off = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
            _kv_heads(row, kw_ptr, q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_off, stride_ch,
                      (hb - nqb) * BLOCK_H, cos, sin, eps, NQ, NKV, HALF, D, BLOCK_H, BLOCK_HALF, BLOCK_TAIL, BLOCK_D,
                      IS_NEOX, HAS_NORM, KV_FP8, FP8_MAX)


def _check_layout(qkv: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, q_norm_weight: torch.Tensor | None,
                  k_norm_weight: torch.Tensor | None) -> None:
    rot = cos_sin_cache.shape[-1]
    if rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"rope_store_kv: cache width {rot} must be even, positive and <= head_dim {head_dim}")
    if qkv.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("rope_store_kv: the last axis of qkv, the cos/sin cache and the KV cache must be contiguous")
    if k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        raise ValueError("rope_store_kv: the K and V caches must share strides and dtype")
    if q_norm_weight is not None and k_norm_weight is not None and q_norm_weight.dtype != k_norm_weight.dtype:
        raise ValueError(f"rope_store_kv: q and k norm weights differ in dtype ({q_norm_weight.dtype} vs "
                         f"{k_norm_weight.dtype})")


@register("rope_store_kv", "triton")
def rope_store_kv(positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  cos_sin_cache: torch.Tensor, is_neox: bool, q_norm_weight: torch.Tensor | None,
                  k_norm_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as the reference (kernels/reference/rope_store.py); returns q [T, num_heads, head_dim]."""
    check_rope_store_args(qkv, num_heads, num_kv_heads, head_dim, positions, q_norm_weight, k_norm_weight,
                          k_cache, v_cache, slot_mapping)
    _check_layout(qkv, cos_sin_cache, head_dim, k_cache, v_cache, q_norm_weight, k_norm_weight)
    has_norm = q_norm_weight is not None
    # the reference's weight multiply promotes (a float32 weight on bf16 activations gives a float32 q)
    out_dtype = torch.promote_types(q_norm_weight.dtype, qkv.dtype) if q_norm_weight is not None else qkv.dtype
    t = qkv.shape[0]
    q = torch.empty(t, num_heads, head_dim, dtype=out_dtype, device=qkv.device)
    if t == 0:
        return q
    half = cos_sin_cache.shape[-1] // 2
    block_half = triton.next_power_of_2(half)
    block_h = min(triton.next_power_of_2(num_heads), max(1, MAX_BLOCK_ELEMS // block_half))
    grid = (t, triton.cdiv(num_heads, block_h) + triton.cdiv(num_kv_heads, block_h))
    qw = q_norm_weight if q_norm_weight is not None else qkv  # unused without the norm
    kw = k_norm_weight if k_norm_weight is not None else qkv
    ks, vs, fp8 = kv_fp8_args(k_cache, v_cache, k_scale, v_scale, "rope_store_kv")
    _rope_store_kernel[grid](
        positions, qkv, cos_sin_cache, qw, kw, q, k_cache, v_cache, slot_mapping, ks, vs,
        qkv.stride(0), cos_sin_cache.stride(0), q.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        NQ=num_heads, NKV=num_kv_heads, HALF=half, D=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_H=block_h,
        BLOCK_HALF=block_half, BLOCK_TAIL=triton.next_power_of_2(max(1, head_dim - 2 * half)),
        BLOCK_D=triton.next_power_of_2(head_dim), IS_NEOX=is_neox, HAS_NORM=has_norm, **fp8, num_warps=4,
        **pdl_kwargs(qkv),
    )
    return q
