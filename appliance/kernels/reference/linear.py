"""The skinny matmuls of decode batches (the GEMV up to 16 rows, the skinny GEMM up to 256); their reference is
torch's (cuBLAS on a GPU)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.kernels.registry import register

GEMV_MAX_ROWS = 16  # the op's contract: callers route at most this many rows to it (decode batches)
SKINNY_GEMM_MAX_ROWS = 256  # likewise for "skinny_gemm": the decode batches of small models, past the GEMV's


@register("gemv", "torch")
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]."""
    return F.linear(x, weight, bias)


@register("skinny_gemm", "torch")
def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N]."""
    return F.linear(x, weight, bias)
