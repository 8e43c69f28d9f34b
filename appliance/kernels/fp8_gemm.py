"""FP8 x FP8 GEMMs with per-row scales: y = (x_q * s_x) (W_q * s_w)^T, the layout of compressed-tensors and
ModelOpt FP8 checkpoints (kernels/../layers/fp8_scaled.py).

Activations are quantized to e4m3 per token (dynamic: each row's amax maps to 448) or with one static scale from
the checkpoint; weights carry one scale per output row (a per-tensor scale is that value repeated). On a GPU with
fp8 tensor cores (sm_89 and later) the product runs in cuBLASLt through torch._scaled_mm with row-wise scales
(float32 accumulation, the output in the activation dtype), except decode batches of up to 16 rows, which take
the Triton FP8 GEMV (kernels/triton/fp8_gemv.py: the same product, over activations act_quant.py quantized);
elsewhere `scaled_mm_reference` computes the same quantized product in float32 (the oracle, and the CPU path).
Where the activation's producer is an RMSNorm or SiLU-and-mul, it can write x already quantized (a QuantizedAct:
kernels/fp8_act.py, layers/fp8_scaled.py `quantize_producers`), and no path quantizes x again.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from appliance.kernels.reference.linear import GEMV_MAX_ROWS
from appliance.kernels.registry import register

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros, not NaN


@register("fp8_quant_act", "torch")
def quantize_activation(x: torch.Tensor, input_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1]): per token when `input_scale` is None, else the static
    per-tensor scale ([1]); saturating, so an outlier above a static scale's range clips instead of turning NaN."""
    xf = x.float()
    if input_scale is None:
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(MIN_SCALE * FP8_MAX) / FP8_MAX
    else:
        scale = input_scale.float().reshape(1, 1).expand(x.shape[0], 1)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.contiguous()


def scaled_mm_reference(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """The quantized product in float32: (xq * x_scale) @ (weight * weight_scale[:, None])^T, as out_dtype."""
    return ((xq.float() * x_scale) @ (weight.float() * weight_scale.float()[:, None]).t()).to(out_dtype)


@dataclass(frozen=True)
class QuantizedAct:
    """An FP8 linear's input quantized by the kernel that produced it (op rms_norm_quant, silu_and_mul_quant):
    e4m3 values [..., K], one float32 scale per row [T, 1] (dynamic per token, as quantize_activation), and the
    16-bit dtype the producer would have written, which the product comes out in."""

    xq: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.xq.shape

    def rows(self) -> QuantizedAct:
        """The same activation with its values as [T, K]."""
        return QuantizedAct(self.xq.reshape(-1, self.xq.shape[-1]), self.scale, self.dtype)


@functools.cache
def _fp8_tensor_cores(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def cublas_ok(dtype: torch.dtype, device: torch.device, weight: torch.Tensor) -> bool:
    """torch._scaled_mm's row-wise path: fp8 tensor cores, a bf16 output, both dims multiples of 16."""
    return (_fp8_tensor_cores(device) and dtype == torch.bfloat16 and weight.shape[0] % 16 == 0
            and weight.shape[1] % 16 == 0)


@register("fp8_gemv", "torch")
def fp8_gemv(x: torch.Tensor | QuantizedAct, weight: torch.Tensor, weight_scale: torch.Tensor,
             input_scale: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The decode-batch op's reference (kernels/triton/fp8_gemv.py): x [M, K] (or a QuantizedAct, used as it is)
    -> [M, N], the quantized product."""
    xq, xs = (x.xq, x.scale) if isinstance(x, QuantizedAct) else quantize_activation(x, input_scale)
    y = scaled_mm_reference(xq, xs, weight, weight_scale, x.dtype)
    return y + bias if bias is not None else y


def _gemv_rows(x: torch.Tensor, dtype: torch.dtype) -> bool:
    """Decode batches on a GPU (up to GEMV_MAX_ROWS rows) take the Triton FP8 GEMV: at M = 1 cuBLASLt's
    scaled GEMM plus the separate activation quantization cost more than streaming the weight bytes."""
    return x.is_cuda and x.shape[0] <= GEMV_MAX_ROWS and dtype in (torch.bfloat16, torch.float16)


def scaled_linear(x: torch.Tensor | QuantizedAct, weight: torch.Tensor, weight_scale: torch.Tensor,
                  input_scale: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] through an e4m3 weight [N, K] with per-row scales [N]; returns [..., N] in x's dtype. x may come
    quantized by its producer (a QuantizedAct, dynamic per-token scales only): every path then uses its e4m3
    rows and scales as they are instead of quantizing x itself."""
    if isinstance(x, QuantizedAct) and input_scale is not None:
        raise ValueError("scaled_linear: a layer with a static input scale was given an activation quantized per "
                         "token by its producer")
    shape, dtype = x.shape, x.dtype
    x2 = x.rows() if isinstance(x, QuantizedAct) else x.reshape(-1, shape[-1])
    values = x2.xq if isinstance(x2, QuantizedAct) else x2
    lead = (*shape[:-1], weight.shape[0])
    if _gemv_rows(values, dtype):
        from appliance.kernels.triton.fp8_gemv import fp8_gemv as triton_fp8_gemv

        return triton_fp8_gemv(x2, weight, weight_scale, input_scale, bias).reshape(lead)
    if isinstance(x2, QuantizedAct):
        xq, xs = x2.xq, x2.scale
    elif x2.is_cuda:  # one launch (kernels/triton/act_quant.py) instead of five torch ops
        from appliance.kernels.triton.act_quant import quant_act

        xq, xs = quant_act(x2.contiguous(), input_scale)
    else:
        xq, xs = quantize_activation(x2, input_scale)
    if cublas_ok(dtype, xq.device, weight):
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=weight_scale.float().reshape(1, -1),
                             out_dtype=dtype)
    else:
        y = scaled_mm_reference(xq, xs, weight, weight_scale, dtype)
    if bias is not None:
        y = y + bias
    return y.reshape(lead)
