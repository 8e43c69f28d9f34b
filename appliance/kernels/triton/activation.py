"""Gated MLP activations over x = cat(gate, up): silu(gate) * up (SwiGLU) and gelu_tanh(gate) * up (GeGLU); and
silu_and_mul_quant, SwiGLU written as e4m3 with a per-token scale for an FP8 down projection."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.fp8_gemm import FP8, FP8_MAX, QuantizedAct
from appliance.kernels.registry import register
from appliance.kernels.triton.act_quant import (
    MIN_AMAX,
    dynamic_scale,
    store_quantized_row,
)
from appliance.kernels.triton.common import pdl_enter, pdl_kwargs
from appliance.kernels.triton.kv_fp8 import saturate

BLOCK_N = 1024
ROW_BLOCK = 16384  # silu_and_mul_quant: rows up to this wide are held whole by one program, wider ones in blocks
WIDE_BLOCK = 4096
SILU, GELU_TANH = 0, 1
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _gated(x_row, offs, mask, inter, ACT: tl.constexpr):
    """act(gate) * up in float32 at columns offs of one row of x = cat(gate, up)."""
    gate = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        act = gate / (1.0 + tl.exp(-gate))
    else:
        # 0.5 * (1 + tanh(z)) = sigmoid(2z): the tanh approximation without a tanh instruction
        z = _SQRT_2_OVER_PI * (gate + 0.044715 * gate * gate * gate)
        act = gate / (1.0 + tl.exp(-2.0 * z))
    return act * up


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, ACT: tl.constexpr, BLOCK_N: tl.constexpr,
                        GDC: tl.constexpr):
    pdl_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < inter
    y = _gated(x_ptr + row * stride_x, offs, mask, inter, ACT)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_and_mul_quant_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, inter, ACT: tl.constexpr,
                              MIN_AMAX: tl.constexpr, FP8_MAX: tl.constexpr, ONE_PASS: tl.constexpr,
                              BLOCK_N: tl.constexpr, GDC: tl.constexpr):
    """One program per row (the scale needs the row's amax): each value rounded to x's dtype as
    _act_and_mul_kernel writes it, then act_quant.py's quantization. A row wider than one block takes two passes,
    the second recomputing the product (x is read back from L2) instead of storing it."""
    pdl_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    q_row = q_ptr + row * stride_q
    offs = tl.arange(0, BLOCK_N)
    dt = x_ptr.dtype.element_ty
    if ONE_PASS:
        mask = offs < inter
        y = _gated(x_row, offs, mask, inter, ACT).to(dt).to(tl.float32)
        store_quantized_row(y, mask, q_row + offs, s_ptr + row, MIN_AMAX, FP8_MAX)
    else:
        amax = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, inter, BLOCK_N):
            y = _gated(x_row, k0 + offs, k0 + offs < inter, inter, ACT).to(dt).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(y))
        scale = dynamic_scale(tl.max(amax, 0), MIN_AMAX, FP8_MAX)
        for k0 in range(0, inter, BLOCK_N):
            mask = k0 + offs < inter
            y = _gated(x_row, k0 + offs, mask, inter, ACT).to(dt).to(tl.float32)
            tl.store(q_row + k0 + offs, saturate(y, scale, FP8_MAX).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row, scale)


def _halves(x: torch.Tensor, name: str) -> tuple[torch.Tensor, int]:
    """x as [T, 2I] rows with the last dim contiguous, and I."""
    two_i = x.shape[-1]
    if two_i % 2:
        raise ValueError(f"{name}: last dim {two_i} is not even")
    x2 = x.reshape(-1, two_i)
    return (x2 if x2.stride(-1) == 1 else x2.contiguous()), two_i // 2


def _act_and_mul(x: torch.Tensor, act: int, name: str) -> torch.Tensor:
    x2, inter = _halves(x, name)
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


@register("silu_and_mul_quant", "triton")
def silu_and_mul_quant(x: torch.Tensor) -> QuantizedAct:
    """silu_and_mul's output as e4m3 with its per-token scale (the bits act_quant.py gives for silu_and_mul's
    output) in one launch."""
    x2, inter = _halves(x, "silu_and_mul_quant")
    q = torch.empty(*x.shape[:-1], inter, dtype=FP8, device=x.device)
    q2 = q.view(-1, inter)
    scales = torch.empty(x2.shape[0], 1, dtype=torch.float32, device=x.device)
    one_pass = inter <= ROW_BLOCK
    block = triton.next_power_of_2(inter) if one_pass else WIDE_BLOCK
    if x2.shape[0]:
        _act_and_mul_quant_kernel[(x2.shape[0],)](x2, q2, scales, x2.stride(0), q2.stride(0), inter, ACT=SILU,
                                                  MIN_AMAX=MIN_AMAX, FP8_MAX=FP8_MAX, ONE_PASS=one_pass,
                                                  BLOCK_N=block, num_warps=min(16, max(4, block // 1024)),
                                                  **pdl_kwargs(x2))
    return QuantizedAct(q, scales, x.dtype)
