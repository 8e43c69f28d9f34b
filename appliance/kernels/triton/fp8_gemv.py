"""FP8 x FP8 GEMV for decode batches (M <= 16 rows): y = (x_q * s_x) (W_q * s_w)^T in one launch, the product
kernels/fp8_gemm.py defines (e4m3 weights with one scale per output row, activations quantized per token or with
one static scale).

At batch 1 torch._scaled_mm pays for a GEMM tiled for large M and a separate activation-quantization launch; a
decode step's linear layers only stream weight bytes, so this kernel does what gemv.py does for 16-bit weights
(one program per BLOCK_N output rows, y^T = W x^T so the weight tile feeds the MMA as stored) on half the bytes.
x is quantized per token (or with one static scale) by its producer (an RMSNorm or SiLU-and-mul that writes a
QuantizedAct: kernels/fp8_act.py), else by act_quant.py's one launch first; the GEMV's loop is then gemv.py's
weight stream (both operands through the async-copy pipeline) on fp8 tiles. Quantizing x inside every program as
it walks K instead (one launch, but the quantized x tile goes through registers into shared memory each step)
streamed Llama-3.1-8B's weights at ~0.26 TB/s on an H100: 98 us for the 25 MB qkv weight against cuBLASLt's 28
us. fp8 operands go to tl.dot on the GPU (float32 accumulation); the interpreter upcasts.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from appliance.kernels import tuned
from appliance.kernels.capability import capability
from appliance.kernels.fp8_gemm import FP8, QuantizedAct
from appliance.kernels.reference.linear import GEMV_MAX_ROWS as MAX_M
from appliance.kernels.registry import register
from appliance.kernels.triton.act_quant import quant_act
from appliance.kernels.triton.common import INTERPRET, pdl_kwargs
from appliance.kernels.triton.gemv import weight_stream


@dataclass(frozen=True)
class Fp8GemvConfig:
    block_n: int = 64
    block_k: int = 256
    num_warps: int = 4
    num_stages: int = 4


def tuned_config(n: int, k: int, arch: str) -> Fp8GemvConfig | None:
    """The tiles that won for an [N, K] weight on a GPU of `arch` (kernels/tuned/<arch>_fp8_gemv.json, written by
    `python -m tools.lab_fp8_gemv --emit`), or None where that shape was not measured."""
    entry = tuned.load("fp8_gemv", arch).get(tuned.shape_key(n, k))
    return None if entry is None else Fp8GemvConfig(**entry)


def config_for(n: int, k: int) -> Fp8GemvConfig:
    """The guess for an unmeasured shape: gemv.py's H100 tiles at twice the K per tile (a byte per weight: the
    same bytes per load)."""
    if INTERPRET:
        return Fp8GemvConfig(block_n=16, block_k=32, num_stages=2)
    return Fp8GemvConfig(block_n=32, block_k=512) if k > 2 * n else Fp8GemvConfig()


@triton.jit
def store_scaled(acc, ws_ptr, x_scale, bias_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym,
                 BIAS: tl.constexpr):
    """y[m, n] = acc^T scaled by the weight row's and the x row's scales (+ bias), in y's dtype."""
    acc = acc * tl.load(ws_ptr + offs_n, mask=n_mask, other=0.0)[:, None] * x_scale[None, :]
    if BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[None, :] & n_mask[:, None])


@triton.jit
def _fp8_stream_kernel(xq_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       UPCAST: tl.constexpr, GDC: tl.constexpr):
    """x quantized ahead (xq e4m3 [M, K], xs float32 [M] per row): gemv.py's weight stream on fp8 tiles."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if GDC:  # launched early: xq is the kernel before's output
        tl.extra.cuda.gdc_wait()
    acc = weight_stream(xq_ptr, stride_xm, w_ptr, stride_wn, offs_n, n_mask, M, 0, K, BLOCK_M, BLOCK_N, BLOCK_K,
                        UPCAST)
    x_scale = tl.load(xs_ptr + offs_m, mask=m_mask, other=0.0)
    store_scaled(acc, ws_ptr, x_scale, bias_ptr, y_ptr, offs_m, offs_n, m_mask, n_mask, stride_ym, BIAS)


@register("fp8_gemv", "triton")
def fp8_gemv(x: torch.Tensor | QuantizedAct, weight: torch.Tensor, weight_scale: torch.Tensor,
             input_scale: torch.Tensor | None, bias: torch.Tensor | None = None,
             config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (16-bit, M <= 16) through an e4m3 weight [N, K] with per-row scales [N] -> [M, N] in x's dtype;
    the contract of kernels/fp8_gemm.scaled_linear. x may be a QuantizedAct (its producer quantized it): then
    the weight stream runs on it as it is. `config` overrides the tiles (tuning)."""
    values = x.xq if isinstance(x, QuantizedAct) else x
    m, k = values.shape if values.dim() == 2 else (0, -1)
    if values.dim() != 2 or m > MAX_M or weight.dtype != FP8 or weight.shape[1] != k or weight.stride(-1) != 1:
        raise ValueError(f"fp8_gemv: x {tuple(values.shape)} does not fit an e4m3 weight {tuple(weight.shape)} "
                         f"{weight.dtype} (at most {MAX_M} rows, K contiguous)")
    n = weight.shape[0]
    measured = tuned_config(n, k, tuned.arch_name(capability(values))) if values.is_cuda else None
    cfg = config or measured or config_for(n, k)
    y = torch.empty(m, n, dtype=x.dtype, device=values.device)
    scale = weight_scale.float().contiguous()
    if not (m and n):
        return y
    grid = (triton.cdiv(n, cfg.block_n),)
    tiles = {"BLOCK_M": 16, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "UPCAST": INTERPRET,
             "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    xq, xs = (x.xq, x.scale) if isinstance(x, QuantizedAct) else quant_act(_k_contiguous(x), input_scale)
    _fp8_stream_kernel[grid](xq, xs, weight, scale, bias if bias is not None else scale, y, m, n, k,
                             xq.stride(0), weight.stride(0), y.stride(0), BIAS=bias is not None, **tiles,
                             **pdl_kwargs(xq))
    return y


def _k_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
