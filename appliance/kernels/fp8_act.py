"""The producers of an FP8 linear's input that write it quantized: ops rms_norm_quant (with or without the
residual add) and silu_and_mul_quant. Their outputs are QuantizedAct (kernels/fp8_gemm.py): e4m3 values and one
float32 scale per row, dynamic per token. These torch versions are the references, exactly the 16-bit op followed
by quantize_activation, so a model gives the same tokens whichever way its activations are quantized; the Triton
kernels (kernels/triton/norm.py, activation.py) do both in the producer's one launch, which saves the
quantization's launch in front of every FP8 GEMV of a decode step. layers/fp8_scaled.py `quantize_producers`
decides where they run."""
from __future__ import annotations

import torch

from appliance.kernels.fp8_gemm import QuantizedAct, quantize_activation
from appliance.kernels.reference.activation import silu_and_mul
from appliance.kernels.reference.norm import rms_norm
from appliance.kernels.registry import register


def quantized(y: torch.Tensor) -> QuantizedAct:
    """y [..., K] quantized per token."""
    xq, scale = quantize_activation(y.reshape(-1, y.shape[-1]), None)
    return QuantizedAct(xq.reshape(y.shape), scale, y.dtype)


@register("rms_norm_quant", "torch")
def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> QuantizedAct | tuple[QuantizedAct, torch.Tensor]:
    """rms_norm (op "rms_norm"'s contract), its output quantized."""
    if residual is None:
        return quantized(rms_norm(x, weight, eps))
    out, summed = rms_norm(x, weight, eps, residual)
    return quantized(out), summed


@register("silu_and_mul_quant", "torch")
def silu_and_mul_quant(x: torch.Tensor) -> QuantizedAct:
    return quantized(silu_and_mul(x))
