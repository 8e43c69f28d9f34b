"""KV-cache store: scatter this step's keys and values into their cache slots (an fp8 cache: divided by the
per-head scales and saturated, kv_fp8.py)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.registry import register
from appliance.kernels.triton.kv_fp8 import kv_fp8_args, saturate


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     HKV: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:  # padding token: nothing to store
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < HKV) & (d < D)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if KV_FP8:
        k = saturate(k, tl.load(k_scale_ptr + h, mask=h < HKV, other=1.0), FP8_MAX)
        v = saturate(v, tl.load(v_scale_ptr + h, mask=h < HKV, other=1.0), FP8_MAX)
    dst = blk.to(tl.int64) * stride_cb + off * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@register("store_kv", "triton")
def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None) -> None:
    n, hkv, d = key.shape
    if value.shape != key.shape or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"store_kv: key {tuple(key.shape)}, value {tuple(value.shape)}, caches "
                         f"{tuple(k_cache.shape)}/{tuple(v_cache.shape)} must match pairwise")
    if k_cache.shape[2:] != (hkv, d) or slot_mapping.shape != (n,):
        raise ValueError(f"store_kv: cache {tuple(k_cache.shape)} / slots {tuple(slot_mapping.shape)} "
                         f"do not fit key {tuple(key.shape)}")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("store_kv: the head_dim axis must be contiguous")
    if n == 0:
        return
    block_size = k_cache.shape[1]
    ks, vs, fp8 = kv_fp8_args(k_cache, v_cache, k_scale, v_scale, "store_kv")
    _store_kv_kernel[(n,)](
        key, value, k_cache, v_cache, slot_mapping, ks, vs,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        HKV=hkv, D=d, BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d), BLOCK_SIZE=block_size,
        **fp8, num_warps=4,
    )
