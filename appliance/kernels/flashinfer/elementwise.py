"""rms_norm (plain and fused with the residual add) and silu_and_mul on flashinfer's kernels.

They take float16/bfloat16 rows whose width is a multiple of 16 bytes, with weights (and residual) of the same
dtype; anything else (float32 models, odd widths, mixed dtypes) runs the torch reference, which computes the same
function.
"""
from __future__ import annotations

import torch

from appliance.kernels.flashinfer.plans import HALF
from appliance.kernels.reference.activation import (
    silu_and_mul as _silu_and_mul_reference,
)
from appliance.kernels.reference.norm import rms_norm as _rms_norm_reference
from appliance.kernels.registry import register


def _fits(x: torch.Tensor, width: int) -> bool:
    return x.is_cuda and x.dtype in HALF and (width * x.element_size()) % 16 == 0 and x.stride(-1) == 1


@register("rms_norm", "flashinfer")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """flashinfer normalises in float32 and multiplies by the weight before rounding once; the reference rounds
    the normalised row first (transformers' order): outputs agree to the dtype's rounding, not bit for bit."""
    import flashinfer

    n = x.shape[-1]
    if weight.shape != (n,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match hidden size {n}")
    if (not _fits(x, n) or weight.dtype != x.dtype  # the reference's output dtype then promotes
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))):
        return _rms_norm_reference(x, weight, eps, residual)
    w = weight.contiguous()
    if residual is None:
        if x.dim() in (2, 3):  # 3-D: per-head q/k norm ([T, H, D], strided rows allowed)
            return flashinfer.rmsnorm(x, w, eps)
        return flashinfer.rmsnorm(x.reshape(-1, n), w, eps).view(x.shape)
    # flashinfer's fused add works in place (residual <- x + residual, x <- norm): on copies, so the caller's
    # tensors stay as they were, like the reference's
    out = x.reshape(-1, n).clone(memory_format=torch.contiguous_format)
    summed = residual.reshape(-1, n).clone(memory_format=torch.contiguous_format)
    flashinfer.fused_add_rmsnorm(out, summed, w, eps)
    return out.view(x.shape), summed.view(x.shape)


@register("silu_and_mul", "flashinfer")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    import flashinfer

    if x.shape[-1] % 2 or not _fits(x, x.shape[-1]):
        return _silu_and_mul_reference(x)
    return flashinfer.silu_and_mul(x.contiguous())
