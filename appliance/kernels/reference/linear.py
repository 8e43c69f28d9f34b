"""The skinny matmul of decode batches; its reference is torch's (cuBLAS on a GPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.kernels.registry import register

GEMV_MAX_ROWS = 16  # the op's contract: callers route at most this many rows to it (decode batches)


@register("gemv", "torch")
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]."""
    return F.linear(x, weight, bias)
