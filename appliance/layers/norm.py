from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from appliance.layers.kernels import kernel

if TYPE_CHECKING:
    from appliance.kernels.fp8_gemm import QuantizedAct


class RMSNorm(nn.Module):
    """RMSNorm through the kernel registry; `forward(x, residual)` fuses the residual add (returns both). After
    `quantize_output()` the output is a QuantizedAct (op rms_norm_quant) instead of a 16-bit tensor."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, backend: str = "torch") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.backend = backend
        self._op = kernel("rms_norm", backend)

    def quantize_output(self) -> None:
        """Write the output as e4m3 with a scale per token in the norm's own kernel: for a norm whose only
        consumer is an FP8 linear with dynamic per-token scales (layers/fp8_scaled.py quantize_producers)."""
        self._op = kernel("rms_norm_quant", self.backend)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | QuantizedAct | tuple[torch.Tensor | QuantizedAct, torch.Tensor]:
        """out, or (out, x + residual); out is a QuantizedAct after quantize_output()."""
        return self._op(x, self.weight, self.eps, residual)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm scales by (1 + weight). The checkpoint's weight is loaded as 1 + weight, so every RMSNorm
    kernel (and the fused q/k norm of rope_store_kv) serves it unchanged; in half precision 1 + w is rounded once
    at load where transformers adds it in float32 each call."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, backend: str = "torch") -> None:
        super().__init__(hidden_size, eps, backend)
        self.weight.weight_loader = self._load  # type: ignore[attr-defined]

    @staticmethod
    def _load(param: torch.nn.Parameter, loaded: torch.Tensor) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"norm weight of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(loaded.float() + 1.0)
