"""The Llama decoder's layers as six kernels each, for batches of at most GEMV_MAX_ROWS rows.

A decode step at batch 1-16 reads every weight once and is as fast as its weight stream, so the small kernels
between the GEMVs (two RMSNorms, rope + KV store, SiLU-and-mul: four of a layer's ten launches) are pure
overhead. Here they ride in the GEMVs' epilogues (kernels/triton/gemv_chain.py): per layer, the qkv GEMV with the
input norm's scale, rotary and the KV store; attention; the o GEMV with the residual add and the next norm's
first half; the gate_up GEMV with the norm's scale and SiLU-and-mul; the down GEMV with the residual add and the
next layer's norm. The residual stream is one tensor updated in place.

Served: dense Llama-family layers (tp 1; no per-head q/k norm; whole-head neox rotary; no bias on o, gate_up or
down) whose four projections stream through a bound GEMV kernel, on a backend that has the chain's ops. Anything
else, or more rows, runs the layers' own forwards. backends.decode_chain (on by default) decides whether the model
runner builds it (executor/runner_setup.py bind_decode_kernels).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from appliance.kernels import registry
from appliance.kernels.reference.linear import GEMV_MAX_ROWS
from appliance.kernels.reference.gemv_chain import rope_store_fits
from appliance.layers.attention import AttentionMetadata
from appliance.layers.parallel_state import get_tp_size

OPS = ("norm_prep", "gemv_normed_rope_store", "gemv_residual", "gemv_normed_silu")


def unserved_reason(model: nn.Module, backend: str) -> str | None:
    """Why `model` (a LlamaModel) cannot run the chain on `backend`, or None when it can. Kernel backends serve
    half precision only (float32 dots would round through tf32), the torch reference any float dtype."""
    dtypes = (torch.bfloat16, torch.float16) if backend != "torch" else (torch.bfloat16, torch.float16, torch.float32)
    if get_tp_size() != 1:
        return "tensor parallelism (o and down need an all-reduce before the residual add)"
    for i, layer in enumerate(model.layers):
        att, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if not all(hasattr(mlp, name) for name in ("gate_up_proj", "down_proj")):
            return f"layer {i} has no dense gated MLP"
        if not all(hasattr(att, name) for name in ("qkv_proj", "o_proj", "rotary", "q_norm", "attn")):
            return f"layer {i} has no Llama attention (fused qkv, rotary)"
        if att.q_norm is not None or not rope_store_fits(att.head_dim, att.rotary.rotary_dim, att.rotary.is_neox,
                                                         False):
            return f"layer {i}'s attention prologue (q/k norm or partial / interleaved rotary)"
        projections = (att.qkv_proj, att.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(p.bias is not None for p in projections[1:]):
            return f"layer {i} has a bias on o, gate_up or down"
        if any(getattr(p, "gemv", None) is None or p.weight.dtype not in dtypes for p in projections):
            return (f"layer {i} has a projection without a bound GEMV or in a dtype {backend!r} does not serve "
                    "(quantized, float32, or not on a GPU)")
    return None


class DecodeChain:
    """Runs a LlamaModel's decoder layers through the chain ops of `backend` (see the module doc)."""

    def __init__(self, model: nn.Module, backend: str) -> None:
        self.model = model
        self.ops = {name: registry.get(name, backend) for name in OPS}

    @classmethod
    def build(cls, model: nn.Module, backend: str) -> DecodeChain | None:
        """The chain for `model`, or None when a layer is not served or the backend lacks the ops."""
        try:
            registry.get(OPS[0], backend)
        except KeyError:
            return None
        return cls(model, backend) if unserved_reason(model, backend) is None else None

    @staticmethod
    def serves(x: torch.Tensor) -> bool:
        """Whether a forward over these embedded tokens takes the chain (at most GEMV_MAX_ROWS of them)."""
        return 0 < x.shape[0] <= GEMV_MAX_ROWS

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: the embedded tokens [T, hidden] (becomes the residual stream, updated in place); returns the final
        norm's output."""
        layers = self.model.layers
        ops = self.ops
        res = x
        xs, parts = ops["norm_prep"](res, layers[0].input_layernorm.weight)
        for i, layer in enumerate(layers):
            att, mlp = layer.self_attn, layer.mlp
            q = self._qkv(att, xs, parts, layer.input_layernorm.eps, positions, meta)
            xs, parts = ops["gemv_residual"](att.attn.attend(q, meta), att.o_proj.weight, res,
                                             layer.post_attention_layernorm.weight)
            act = ops["gemv_normed_silu"](xs, mlp.gate_up_proj.weight, parts, layer.post_attention_layernorm.eps)
            nxt = layers[i + 1].input_layernorm.weight if i + 1 < len(layers) else None
            prep: Any = ops["gemv_residual"](act, mlp.down_proj.weight, res, nxt)
            if prep is not None:
                xs, parts = prep
        return self.model.norm(res)

    def _qkv(self, att: nn.Module, xs: torch.Tensor, parts: torch.Tensor, eps: float, positions: torch.Tensor,
             meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = att.attn.kv_cache()
        return self.ops["gemv_normed_rope_store"](
            xs, att.qkv_proj.weight, att.qkv_proj.bias, parts, eps, positions, att.num_heads, att.num_kv_heads,
            att.head_dim, att.rotary.cos_sin_cache, k_cache, v_cache, meta.slot_mapping, **att.attn.kv_scales)
