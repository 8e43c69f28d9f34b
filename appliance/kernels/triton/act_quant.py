"""Activation quantization for the FP8 x FP8 GEMMs (kernels/fp8_gemm.py) in one launch: each row of x to e4m3
with its own scale (amax / 448, dynamic per token) or one static scale, saturating. The torch ops it replaces
(abs, amax, divide, clamp, cast) are five launches and three passes over x per linear layer.

`dynamic_scale` and `store_quantized_row` are the per-token quantization every Triton producer of an FP8 GEMM's
input shares: this launch, and the RMSNorm and SiLU-and-mul kernels that write their output quantized
(norm.py, activation.py), so all of them give the same e4m3 bits for the same 16-bit row."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.fp8_gemm import FP8, FP8_MAX, MIN_SCALE
from appliance.kernels.registry import register
from appliance.kernels.triton.kv_fp8 import saturate

BLOCK = 1024
MIN_AMAX = MIN_SCALE * FP8_MAX  # the launch argument of the kernels below: an all-zero row's scale is MIN_SCALE


@triton.jit
def dynamic_scale(amax, MIN_AMAX: tl.constexpr, FP8_MAX: tl.constexpr):
    """A row's per-token scale from its amax (float32): amax / 448, never below MIN_SCALE."""
    return tl.maximum(amax, MIN_AMAX) / FP8_MAX


@triton.jit
def store_quantized_row(y, mask, q_ptrs, s_ptr, MIN_AMAX: tl.constexpr, FP8_MAX: tl.constexpr):
    """A whole row held by one program (y float32, the 16-bit values a producer would have written) -> e4m3 at
    q_ptrs and its scale at s_ptr."""
    scale = dynamic_scale(tl.max(tl.where(mask, tl.abs(y), 0.0), 0), MIN_AMAX, FP8_MAX)
    tl.store(q_ptrs, saturate(y, scale, FP8_MAX).to(q_ptrs.dtype.element_ty), mask=mask)
    tl.store(s_ptr, scale)


@triton.jit
def _quant_rows(x_ptr, q_ptr, s_ptr, static_ptr, K, stride_x, stride_q, MIN_AMAX: tl.constexpr,
                FP8_MAX: tl.constexpr, STATIC: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:  # the row's amax (a second pass reads it back from L2)
        amax = tl.zeros([BLOCK], tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = dynamic_scale(tl.max(amax, 0), MIN_AMAX, FP8_MAX)
    for k0 in range(0, K, BLOCK):
        mask = k0 + offs < K
        x = tl.load(x_ptr + row * stride_x + k0 + offs, mask=mask, other=0.0)
        tl.store(q_ptr + row * stride_q + k0 + offs, saturate(x, scale, FP8_MAX).to(q_ptr.dtype.element_ty),
                 mask=mask)
    tl.store(s_ptr + row, scale)


@register("fp8_quant_act", "triton")
def quant_act(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as kernels/fp8_gemm.quantize_activation: x [M, K] -> (e4m3 [M, K], float32 [M, 1])."""
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"fp8_quant_act: x must be [M, K] with K contiguous, got {tuple(x.shape)} {x.stride()}")
    m, k = x.shape
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    scales = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m:
        _quant_rows[(m,)](x, q, scales, input_scale if input_scale is not None else scales, k, x.stride(0),
                          q.stride(0), MIN_AMAX=MIN_AMAX, FP8_MAX=FP8_MAX, STATIC=input_scale is not None,
                          BLOCK=BLOCK, num_warps=4)
    return q, scales
