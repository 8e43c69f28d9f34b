"""RMSNorm, optionally fused with the residual add that precedes it, and optionally writing its output as e4m3
with a per-token scale for an FP8 linear (rms_norm_quant: a program holds the whole row, so the row's amax is
one more reduction); and norm_add_norm, a sandwich-norm block's output norm, its residual add and the next norm
(Gemma 3) in one launch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.fp8_gemm import FP8, FP8_MAX, QuantizedAct
from appliance.kernels.registry import register
from appliance.kernels.triton.act_quant import MIN_AMAX, store_quantized_row
from appliance.kernels.triton.common import pdl_enter, pdl_kwargs


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, scale_ptr, stride_x, stride_r, stride_o, stride_s, n,
                     eps, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, MIN_AMAX: tl.constexpr,
                     FP8_MAX: tl.constexpr, BLOCK_N: tl.constexpr, GDC: tl.constexpr):
    pdl_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # rounded like the reference
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, 0) / n + eps)
    normed = (h * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if QUANT:  # out is e4m3: the row rounded as the 16-bit output would be, then act_quant.py's quantization
        y = (w * normed).to(x_ptr.dtype.element_ty).to(tl.float32)
        store_quantized_row(y, mask, out_ptr + row * stride_o + offs, scale_ptr + row, MIN_AMAX, FP8_MAX)
    else:
        tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None, out: torch.Tensor,
          scales: torch.Tensor | None) -> torch.Tensor | None:
    """One launch of _rms_norm_kernel into `out` (16-bit, or e4m3 with `scales` [rows, 1]); returns the sum with
    the residual when there is one."""
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {n}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    x2, out2 = _rows(x, n), out.view(-1, n)
    rows = x2.shape[0]
    summed = None
    r2 = s2 = x2  # unused without a residual
    if residual is not None:
        summed = torch.empty_like(x, memory_format=torch.contiguous_format)
        r2, s2 = _rows(residual, n), summed.view(-1, n)
    block = triton.next_power_of_2(n)
    if rows:
        _rms_norm_kernel[(rows,)](x2, r2, weight, out2, s2, scales if scales is not None else x2, x2.stride(0),
                                  r2.stride(0), out2.stride(0), s2.stride(0), n, eps,
                                  HAS_RESIDUAL=residual is not None, QUANT=scales is not None, MIN_AMAX=MIN_AMAX,
                                  FP8_MAX=FP8_MAX, BLOCK_N=block, num_warps=min(16, max(1, block // 256)),
                                  **pdl_kwargs(x2))
    return summed


@register("rms_norm", "triton")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    summed = _norm(x, weight, eps, residual, out, None)
    return (out, summed) if summed is not None else out


@register("rms_norm_quant", "triton")
def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> QuantizedAct | tuple[QuantizedAct, torch.Tensor]:
    """rms_norm whose output row is written as e4m3 with its per-token scale (the bits act_quant.py gives for
    rms_norm's output) in the same launch; x and weight share a 16-bit dtype, the output's."""
    if weight.dtype != x.dtype:
        raise ValueError(f"rms_norm_quant: x {x.dtype} and weight {weight.dtype} must share a dtype")
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    scales = torch.empty(x.numel() // max(1, x.shape[-1]), 1, dtype=torch.float32, device=x.device)
    summed = _norm(x, weight, eps, residual, out, scales)
    act = QuantizedAct(out, scales, x.dtype)
    return (act, summed) if summed is not None else act


@triton.jit
def _norm_add_norm_kernel(x_ptr, res_ptr, w1_ptr, w2_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o,
                          stride_s, n, eps, BLOCK_N: tl.constexpr, GDC: tl.constexpr):
    pdl_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n
    dt = x_ptr.dtype.element_ty
    # every intermediate rounded where the two rms_norm calls it replaces round it
    h = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, 0) / n + eps)
    w1 = tl.load(w1_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    normed = (w1 * (h * inv).to(dt).to(tl.float32)).to(dt)
    r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    s = (normed.to(tl.float32) + r).to(dt)
    tl.store(sum_ptr + row * stride_s + offs, s, mask=mask)
    s32 = s.to(tl.float32)
    inv2 = tl.rsqrt(tl.sum(s32 * s32, 0) / n + eps)
    w2 = tl.load(w2_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (w2 * (s32 * inv2).to(dt).to(tl.float32)).to(dt), mask=mask)


@register("norm_add_norm", "triton")
def norm_add_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, next_weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm(x) added to the residual stream, then the next rms_norm of the sum, in one pass over the row."""
    n = x.shape[-1]
    if weight.shape != (n,) or next_weight.shape != (n,):
        raise ValueError(f"norm_add_norm: weights {tuple(weight.shape)}, {tuple(next_weight.shape)} do not match "
                         f"hidden size {n}")
    if residual.shape != x.shape:
        raise ValueError(f"norm_add_norm: residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    if weight.dtype != x.dtype or next_weight.dtype != x.dtype or residual.dtype != x.dtype:
        raise ValueError(f"norm_add_norm: x, residual and weights must share a dtype, got {x.dtype}, "
                         f"{residual.dtype}, {weight.dtype}, {next_weight.dtype}")
    x2, r2 = _rows(x, n), _rows(residual, n)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    summed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2, s2 = out.view(-1, n), summed.view(-1, n)
    block = triton.next_power_of_2(n)
    if x2.shape[0]:
        _norm_add_norm_kernel[(x2.shape[0],)](x2, r2, weight, next_weight, out2, s2, x2.stride(0), r2.stride(0),
                                              out2.stride(0), s2.stride(0), n, eps, BLOCK_N=block,
                                              num_warps=min(16, max(1, block // 256)), **pdl_kwargs(x2))
    return out, summed
