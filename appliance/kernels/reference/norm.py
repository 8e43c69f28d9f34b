from __future__ import annotations

import torch

from appliance.kernels.registry import register


@register("rms_norm", "torch")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm in float32, like transformers; with `residual`, normalises x + residual and returns the sum too."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
        summed = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return (out, summed) if residual is not None else out
