from __future__ import annotations

import torch
import torch.nn.functional as F

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


@register("norm_add_norm", "torch")
def norm_add_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor, next_weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A sandwich-norm block's tail (Gemma 3): s = residual + rms_norm(x, weight), returns (rms_norm(s,
    next_weight), s): the two rms_norm calls it stands for, rounded as they round."""
    out, summed = rms_norm(rms_norm(x, weight, eps), next_weight, eps, residual)
    return out, summed


@register("gated_rms_norm", "torch")
def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (weight, not 1 + weight) times SiLU(gate), in float32 like transformers'
    Qwen3NextRMSNormGated: the Gated DeltaNet layer's output norm, x [T, H, D] and gate [T, H, D] or [T, Hk, G * D]
    (grouped per key head, head h = kh * G + j) -> x's dtype."""
    gate = gate.reshape(x.shape)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return ((weight * h.to(x.dtype)) * F.silu(gate.float())).to(x.dtype)
