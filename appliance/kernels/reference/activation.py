from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.kernels.registry import register


@register("silu_and_mul", "torch")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


@register("gelu_tanh_and_mul", "torch")
def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up: Gemma's GeGLU (hidden_activation gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
