"""The fused attention prologue in plain torch: per-head q/k RMSNorm (optional), rotary, KV-cache store.

Exactly the composition of the reference `rms_norm`, `rope` and `store_kv` the unfused layer runs, so a model on
the torch backend gives the same bits whichever path it takes; the oracle for the Triton `rope_store_kv`.
"""
from __future__ import annotations

import torch

from appliance.kernels.reference.attention import store_kv
from appliance.kernels.reference.norm import rms_norm
from appliance.kernels.reference.rope import rope
from appliance.kernels.registry import register


def check_rope_store_args(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                          positions: torch.Tensor, q_norm_weight: torch.Tensor | None,
                          k_norm_weight: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_mapping: torch.Tensor) -> None:
    """Shape checks shared by every backend; ValueError naming the disagreement."""
    t = qkv.shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"rope_store_kv: qkv {tuple(qkv.shape)} is not [T, (heads {num_heads} + 2 x kv heads "
                         f"{num_kv_heads}) x head_dim {head_dim} = {width}]")
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"rope_store_kv: {num_heads} heads are not a multiple of {num_kv_heads} kv heads")
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(f"rope_store_kv: positions {tuple(positions.shape)} / slots {tuple(slot_mapping.shape)} "
                         f"do not match {t} rows")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("rope_store_kv: give both q and k norm weights or neither")
    for name, w in (("q", q_norm_weight), ("k", k_norm_weight)):
        if w is not None and w.shape != (head_dim,):
            raise ValueError(f"rope_store_kv: {name} norm weight {tuple(w.shape)} is not [{head_dim}]")
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"rope_store_kv: caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} are not "
                         f"[blocks, block_size, {num_kv_heads}, {head_dim}]")


@register("rope_store_kv", "torch")
def rope_store_kv(positions: torch.Tensor, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                  cos_sin_cache: torch.Tensor, is_neox: bool, q_norm_weight: torch.Tensor | None,
                  k_norm_weight: torch.Tensor | None, eps: float, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """q of one attention layer, rotated (and normed per head when weights are given); k and v go to the cache.

    qkv: [T, (num_heads + 2 num_kv_heads) * head_dim], the qkv projection's output (its row stride may exceed
    its width). Caches: [blocks, block_size, num_kv_heads, head_dim]; slot -1 stores nothing (q is still computed).
    Returns q [T, num_heads, head_dim], contiguous. An fp8 cache stores k and v as store_kv does (its
    k_scale / v_scale).
    """
    check_rope_store_args(qkv, num_heads, num_kv_heads, head_dim, positions, q_norm_weight, k_norm_weight,
                          k_cache, v_cache, slot_mapping)
    t = qkv.shape[0]
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(t, num_heads, head_dim)
    k = k.reshape(t, num_kv_heads, head_dim)
    if q_norm_weight is not None and k_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    q, k = rope(positions, q, k, cos_sin_cache, is_neox)
    store_kv(k, v.view(t, num_kv_heads, head_dim), k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q
