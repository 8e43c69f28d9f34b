"""Rotary position embeddings: a cos/sin cache per position, applied through the kernel registry's `rope` op.

Scaling follows the HF `rope_parameters` / `rope_scaling` dict: default, linear, llama3 (Llama 3.1's
wavelength-dependent frequency interpolation), yarn (NTK-by-parts with an attention factor on cos/sin, gpt-oss;
DeepSeek's MLA builds its own table from the same helpers). Any other rope_type is an error rather than silently
unscaled.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from appliance.layers.kernels import kernel

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def rope_parameters(hf_config: PretrainedConfig) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling dict or None) from a transformers config of either the 4.x or 5.x shape."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = None if params.get("rope_type", "default") == "default" else dict(params)
        return theta, scaling
    theta = float(getattr(hf_config, "rope_theta", 10000.0))
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return theta, scaling


def _inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    # float32 like transformers, so our cache matches the reference bit for bit
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(dim: int, base: float, factor: float, scaling: dict[str, Any]) -> torch.Tensor:
    """NTK-by-parts interpolation: high-frequency dims kept, low-frequency dims divided by factor."""
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    old_ctx = float(scaling["original_max_position_embeddings"])

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def yarn_factors(scaling: dict[str, Any], max_position: int) -> tuple[float, float]:
    """(factor, attention factor on cos/sin) of a YaRN scaling dict, as transformers derives them."""
    factor = scaling.get("factor")
    factor = float(factor if factor is not None else max_position / float(scaling["original_max_position_embeddings"]))
    mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if scaling.get("attention_factor") is not None:
        return factor, float(scaling["attention_factor"])
    if mscale and mscale_all:
        return factor, yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all))
    return factor, yarn_mscale(factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None, is_neox: bool = True, backend: str = "torch") -> None:
        super().__init__()
        self.head_dim, self.rotary_dim, self.is_neox = head_dim, rotary_dim, is_neox
        self._op = kernel("rope", backend)
        if torch.get_default_device().type == "meta":
            # the memory check's build (executor/memory_check.py) needs only the shape; computing on the meta
            # device would import torch's decompositions and dynamo, most of a second of start-up
            self.register_buffer("cos_sin_cache", torch.empty(max_position, rotary_dim, dtype=torch.float32),
                                 persistent=False)
            return
        inv_freq = _inv_freq(rotary_dim, base)
        positions = torch.arange(max_position, dtype=torch.float32)
        attn_factor = 1.0
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind == "llama3":
                inv_freq = _llama3_inv_freq(inv_freq, scaling)
            elif kind == "linear":
                positions = positions / float(scaling["factor"])
            elif kind == "yarn":
                factor, attn_factor = yarn_factors(scaling, max_position)
                inv_freq = yarn_inv_freq(rotary_dim, base, factor, scaling)
            else:
                raise ValueError(f"rope scaling type {kind!r} is not supported "
                                 "(supported: default, linear, llama3, yarn)")
        freqs = torch.outer(positions, inv_freq)
        cache = torch.cat((freqs.cos() * attn_factor, freqs.sin() * attn_factor), dim=-1)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._op(positions, q, k, self.cos_sin_cache, self.is_neox)
