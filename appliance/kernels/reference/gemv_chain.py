"""The decode layer's GEMVs with its small ops folded into them, in plain torch: the oracle of the Triton
`gemv_chain` kernels (kernels/triton/gemv_chain.py) and the CPU path of the fused decode layer
(layers/decode_chain.py).

An RMSNorm is split between the GEMV that writes its input and the GEMV that reads its output, so that no kernel
of its own runs in between: the producer adds its product to the residual stream and writes h, h * g (g the
next norm's weight) and the partial sums of h^2 over its columns; the consumer streams W (h * g) and scales each
row by rsqrt(mean(h^2) + eps) at the end, since the norm's scale is one number per row. Partials are float32
[M, P] whose rows sum to sum(h^2); how many columns P a backend writes is its own choice.

The rounding differs from the unfused chain (which rounds h * rsqrt(...) to the activation dtype before the
weight multiply) by that one rounding step; greedy tokens and logprobs are checked against transformers like
every path (tests/test_decode_chain.py).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from appliance.kernels.reference.activation import silu_and_mul
from appliance.kernels.reference.rope_store import rope_store_kv
from appliance.kernels.registry import register

PAIRS = 32  # rotary pairs a qkv program owns on the Triton backend (64 rows: one warpgroup MMA)


def rope_store_fits(head_dim: int, rotary_dim: int, is_neox: bool, has_qk_norm: bool) -> bool:
    """Whether `gemv_normed_rope_store` serves a layer: neox rotary over whole heads whose half is a multiple of
    PAIRS, and no per-head q/k norm (that needs a whole head per program)."""
    return is_neox and rotary_dim == head_dim and (head_dim // 2) % PAIRS == 0 and not has_qk_norm


def row_scale(partials: torch.Tensor, hidden: int, eps: float) -> torch.Tensor:
    """rsqrt(mean(h^2) + eps) per row, [M, 1] float32, from the producer's partial sums."""
    return torch.rsqrt(partials.sum(-1, keepdim=True) / hidden + eps)


def normed_linear(xs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, partials: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """(xs W^T) * rsqrt(mean(h^2) + eps) (+ bias), rounded once to xs's dtype."""
    y = F.linear(xs.float(), weight.float()) * row_scale(partials, xs.shape[-1], eps)
    return (y + bias.float() if bias is not None else y).to(xs.dtype)


@register("norm_prep", "torch")
def norm_prep(h: torch.Tensor, norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The first layer's producer half of an RMSNorm, for a residual stream h that no GEMV wrote: (h * g, sum h^2)."""
    hf = h.float()
    return (hf * norm_weight.float()).to(h.dtype), hf.pow(2).sum(-1, keepdim=True)


@register("gemv_residual", "torch")
def gemv_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                  norm_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """residual += x W^T in place (the product rounded first, like F.linear then the add); with `norm_weight`,
    the producer half of the next RMSNorm: returns (residual * g, partial sums of residual^2)."""
    y = F.linear(x, weight)
    residual.copy_((y.float() + residual.float()).to(residual.dtype))
    return norm_prep(residual, norm_weight) if norm_weight is not None else None


@register("gemv_normed_silu", "torch")
def gemv_normed_silu(xs: torch.Tensor, weight: torch.Tensor, partials: torch.Tensor, eps: float) -> torch.Tensor:
    """silu(gate) * up of the normed gate_up projection: weight [2 I, K] holds gate's rows, then up's."""
    return silu_and_mul(normed_linear(xs, weight, None, partials, eps))


@register("gemv_normed_rope_store", "torch")
def gemv_normed_rope_store(xs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           partials: torch.Tensor, eps: float, positions: torch.Tensor, num_heads: int,
                           num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                           v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The normed qkv projection, then neox rotary over whole heads and the KV store (rope_store_kv's contract,
    without q/k norms; fp8 caches with their scales); returns q [M, num_heads, head_dim]."""
    qkv = normed_linear(xs, weight, bias, partials, eps)
    return rope_store_kv(positions, qkv, num_heads, num_kv_heads, head_dim, cos_sin_cache, True, None, None, 0.0,
                         k_cache, v_cache, slot_mapping, k_scale, v_scale)
