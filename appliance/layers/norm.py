from __future__ import annotations

import torch
from torch import nn

from appliance.layers.kernels import kernel


class RMSNorm(nn.Module):
    """RMSNorm through the kernel registry; `forward(x, residual)` fuses the residual add (returns both)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, backend: str = "torch") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self._op = kernel("rms_norm", backend)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._op(x, self.weight, self.eps, residual)
