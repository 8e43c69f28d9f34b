"""The skinny matmuls of decode batches; their reference is torch's (cuBLAS on a GPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.kernels.reference.activation import silu_and_mul
from appliance.kernels.reference.norm import rms_norm
from appliance.kernels.registry import register

GEMV_MAX_ROWS = 16  # the op's contract: callers route at most this many rows to it (decode batches)


@register("gemv", "torch")
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]."""
    return F.linear(x, weight, bias)


@register("fused_gemv", "torch")
def fused_gemv(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               residual: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """A decoder layer's projection with its neighbours, for <= GEMV_MAX_ROWS rows:
    rms_norm(x, norm_weight, eps) feeds the product when norm_weight is given; gated: weight stacks [gate; up]
    and the output is silu(x gate^T) * (x up^T), [M, N / 2]; residual is added to the output."""
    h = rms_norm(x, norm_weight, eps) if norm_weight is not None else x
    y = F.linear(h, weight)
    if gated:
        y = silu_and_mul(y)
    if residual is not None:
        y = (y.float() + residual.float()).to(y.dtype)
    return y
