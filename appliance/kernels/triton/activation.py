"""SiLU-and-mul: the gated MLP activation, silu(gate) * up over x = cat(gate, up)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.registry import register
from appliance.kernels.triton.common import pdl_enter, pdl_kwargs

BLOCK_N = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK_N: tl.constexpr, GDC: tl.constexpr):
    pdl_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


@register("silu_and_mul", "triton")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul: last dim {two_i} is not even")
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, BLOCK_N))](x2, out2, x2.stride(0), out2.stride(0),
                                                                       inter, BLOCK_N=BLOCK_N, num_warps=4,
                                                                       **pdl_kwargs(x2))
    return out
