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
