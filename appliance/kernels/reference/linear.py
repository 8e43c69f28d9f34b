"""The skinny matmul of decode batches; its reference is torch's (cuBLAS on a GPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.kernels.reference.norm import rms_norm
from appliance.kernels.registry import register

GEMV_MAX_ROWS = 16  # the op's contract: callers route at most this many rows to it (decode batches)


@register("gemv", "torch")
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]."""
    return F.linear(x, weight, bias)


@register("gemv_rms_norm", "torch")
def gemv_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rms_norm(x + residual) @ weight^T (+ bias) and the residual sum (None without a residual): exactly the
    reference rms_norm, then the reference linear (the GEMV kernels fuse the norm into their prologue)."""
    if residual is None:
        return gemv(rms_norm(x, norm_weight, eps), weight, bias), None
    h, summed = rms_norm(x, norm_weight, eps, residual)
    return gemv(h, weight, bias), summed
