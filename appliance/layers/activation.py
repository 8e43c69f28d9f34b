from __future__ import annotations

import torch
from torch import nn

from appliance.layers.kernels import kernel


class SiluAndMul(nn.Module):
    """silu(gate) * up over the two halves of the fused gate_up projection."""

    def __init__(self, backend: str = "torch") -> None:
        super().__init__()
        self._op = kernel("silu_and_mul", backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x)
