"""Gated MLP activations over x = cat(gate, up): silu(gate) * up (SwiGLU) and gelu_tanh(gate) * up (GeGLU)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.registry import register
from appliance.kernels.triton.common import pdl_enter, pdl_kwargs

BLOCK_N = 1024
SILU, GELU_TANH = 0, 1
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                        GDC: tl.constexpr):
    pdl_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        # 0.5 * (1 + tanh(z)) = sigmoid(2z): the tanh approximation without a tanh instruction
        z = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * z))
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, act: int, name: str) -> torch.Tensor:
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"{name}: last dim {two_i} is not even")
    inter = two_i // 2
    x2 = x.reshape(-1, two_i)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, inter)
    if x2.shape[0]:
        _act_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, BLOCK_N))](x2, out2, x2.stride(0), out2.stride(0),
                                                                      inter, ACT=act, BLOCK_N=BLOCK_N, num_warps=4,
                                                                      **pdl_kwargs(x2))
    return out


@register("silu_and_mul", "triton")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _act_and_mul(x, SILU, "silu_and_mul")


@register("gelu_tanh_and_mul", "triton")
def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Gemma's GeGLU in one launch (the reference's gelu and mul are two passes over [T, I])."""
    return _act_and_mul(x, GELU_TANH, "gelu_tanh_and_mul")
