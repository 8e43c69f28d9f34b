"""RMSNorm, optionally fused with the residual add that precedes it."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.registry import register
from appliance.kernels.triton.common import pdl_enter, pdl_kwargs


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK_N: tl.constexpr, GDC: tl.constexpr):
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
    tl.store(out_ptr + row * stride_o + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


@register("rms_norm", "triton")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {n}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual {tuple(residual.shape)} differs from x {tuple(x.shape)}")
    x2 = _rows(x, n)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    out2 = out.view(-1, n)
    rows = x2.shape[0]
    if residual is not None:
        r2 = _rows(residual, n)
        summed = torch.empty_like(x, memory_format=torch.contiguous_format)
        s2 = summed.view(-1, n)
    else:
        r2 = s2 = x2  # unused
    block = triton.next_power_of_2(n)
    if rows:
        _rms_norm_kernel[(rows,)](x2, r2, weight, out2, s2, x2.stride(0), r2.stride(0), out2.stride(0),
                                  s2.stride(0), n, eps, HAS_RESIDUAL=residual is not None, BLOCK_N=block,
                                  num_warps=min(16, max(1, block // 256)), **pdl_kwargs(x2))
    return (out, summed) if residual is not None else out
