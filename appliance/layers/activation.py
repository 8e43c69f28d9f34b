from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from appliance.layers.kernels import kernel

if TYPE_CHECKING:
    from appliance.kernels.fp8_gemm import QuantizedAct

# HF hidden_act / hidden_activation -> the registry's gate-times-up op over a fused gate_up projection
GATED_ACTIVATIONS = {"silu": "silu_and_mul", "gelu_pytorch_tanh": "gelu_tanh_and_mul"}


class SiluAndMul(nn.Module):
    """silu(gate) * up over the two halves of the fused gate_up projection; after `quantize_output()` a
    QuantizedAct (op silu_and_mul_quant) instead of a 16-bit tensor."""

    def __init__(self, backend: str = "torch") -> None:
        super().__init__()
        self.backend = backend
        self._op = kernel("silu_and_mul", backend)

    def quantize_output(self) -> None:
        """Write the product as e4m3 with a scale per token in the activation's own kernel: for an activation
        whose only consumer is an FP8 linear with dynamic per-token scales (layers/fp8_scaled.py
        quantize_producers)."""
        self._op = kernel("silu_and_mul_quant", self.backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor | QuantizedAct:
        """The product: a tensor, or a QuantizedAct after quantize_output()."""
        return self._op(x)


class GatedActivation(nn.Module):
    """act(gate) * up for any act in GATED_ACTIVATIONS (a clear error for the others)."""

    def __init__(self, hidden_act: str, backend: str = "torch") -> None:
        super().__init__()
        if hidden_act not in GATED_ACTIVATIONS:
            raise ValueError(f"hidden activation {hidden_act!r} is not supported "
                             f"(supported: {', '.join(GATED_ACTIVATIONS)})")
        self._op = kernel(GATED_ACTIVATIONS[hidden_act], backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x)
