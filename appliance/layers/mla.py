"""Multi-head latent attention (DeepSeek-V2/V3) with a compressed paged cache.

Per token the cache keeps kv_lora_rank + qk_rope_head_dim values (the normalized latent c_kv and the rotated
shared key k_pe) instead of per-head K and V. Decode rows use the absorbed form: W_UK (the key half of kv_b_proj)
is folded into the query, attention runs against the latents directly (MQA with one 'head' of width R + dr),
and W_UV (the value half) is applied to the latent-space result. Prefill rows go to the `mla_prefill` op: the
torch reference expands the context's latents through kv_b_proj into per-head keys and values; the Triton kernel
(kernels/mla/triton_prefill.py) stays absorbed, causal over the latents, and expands nothing. All read the same
cache, so a request may prefill, hit the prefix cache and decode in any order.

Rotary: DeepSeek rotates interleaved pairs (GPT-J style; V3 with rope_interleave=false rotates halves) over the
rope dims only, and YaRN scaling adds an attention factor to cos/sin plus mscale^2 to the softmax scale.
"""
from __future__ import annotations

import json
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

import appliance.kernels.mla  # noqa: F401  (registers the mla ops)
from appliance.kernels.reference.kv_quant import is_fp8
from appliance.layers.attention import AttentionMetadata
from appliance.layers.fp8 import Fp8BlockConfig, dense_weight, make_linear
from appliance.layers.kernels import kernel
from appliance.layers.norm import RMSNorm
from appliance.layers.parallel_state import divide, get_tp_size
from appliance.layers.rotary import (
    rope_parameters,
    yarn_factors,
    yarn_inv_freq,
    yarn_mscale,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


# one cos/sin table per shape and device, shared by every layer (weakly held: freed with the last model using
# it): 62 DeepSeek-V3 layers at 163840 positions would otherwise hold 2.6 GB of identical copies per GPU
_ROPE_TABLES: weakref.WeakValueDictionary[tuple[Any, ...], torch.Tensor] = weakref.WeakValueDictionary()


def rope_cache_and_mscale(cfg: PretrainedConfig, dim: int) -> tuple[torch.Tensor, float]:
    """(cos_sin_cache [max_pos, dim], softmax-scale multiplier) for DeepSeek's default or YaRN rope."""
    base, scaling = rope_parameters(cfg)
    max_pos = int(cfg.max_position_embeddings)
    attn_factor, softmax_mult, factor = 1.0, 1.0, 1.0
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "yarn":
            raise ValueError(f"DeepSeek rope scaling {kind!r} is not supported (supported: default, yarn)")
        factor, attn_factor = yarn_factors(scaling, max_pos)
        mscale_all = scaling.get("mscale_all_dim")
        if mscale_all:
            softmax_mult = yarn_mscale(factor, float(mscale_all)) ** 2
    if torch.get_default_device().type == "meta":  # the memory check's build: the shape only (layers/rotary.py)
        key = (base, json.dumps(scaling, sort_keys=True, default=str), max_pos, dim, "meta")
        return _ROPE_TABLES.setdefault(key, torch.empty(max_pos, dim, dtype=torch.float32)), softmax_mult
    if scaling is None:
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    else:
        inv_freq = yarn_inv_freq(dim, base, factor, scaling)
    key = (base, json.dumps(scaling, sort_keys=True, default=str), max_pos, dim, str(inv_freq.device))
    cache = _ROPE_TABLES.get(key)
    if cache is None:
        freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
        cache = torch.cat((freqs.cos() * attn_factor, freqs.sin() * attn_factor), dim=-1)
        _ROPE_TABLES[key] = cache
    return cache, softmax_mult


class LatentObserver(Protocol):
    """Sees a layer's latents before they are stored (executor/kv_calibration.py: online fp8 scales)."""

    def observe_latent(self, layer: MLAAttention, latent: torch.Tensor, meta: AttentionMetadata) -> None: ...


class MLAAttention(nn.Module):
    """The cache-facing half: stores latents and runs the decode (absorbed) and prefill (expanded) kernels.

    To the model runner it looks like a one-kv-head layer of head_dim kv_lora_rank + rope_dim; it uses the
    K cache only (the V cache it may be handed is ignored).
    """

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, backend: str = "torch") -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale = scale
        self.num_kv_heads, self.head_dim = 1, kv_lora_rank + qk_rope_head_dim
        self.uses_v_cache = False
        self._store = kernel("mla_store", backend)
        self._decode = kernel("mla_decode", backend)
        self._prefill = kernel("mla_prefill", backend)
        self.k_cache: torch.Tensor | None = None
        self.kv_scale: torch.Tensor | None = None  # an fp8 latent cache's one scale ([1] float32)
        self.kv_scales: dict[str, torch.Tensor] = {}  # the ops' keyword for the bound cache ({} if 16-bit)
        self.kv_ready: Callable[[], None] | None = None  # the host tier's wait for this layer (as Attention's)
        self.calibration: LatentObserver | None = None  # set while online KV scale calibration is open

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        """executor/kv_scales.py's call: one latent tensor, one scale (k's; the latent is also the value)."""
        if k_scale.shape != (1,) or k_scale.dtype != torch.float32:
            raise ValueError(f"an MLA latent cache has one scale, got {tuple(k_scale.shape)} {k_scale.dtype}")
        self.kv_scale = k_scale

    def bind_kv_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None = None) -> None:
        if k_cache is not None and (k_cache.shape[-1] != self.head_dim or k_cache.shape[-2] != 1):
            raise ValueError(f"MLA cache must be [blocks, block_size, 1, {self.head_dim}], got {tuple(k_cache.shape)}")
        self.k_cache = k_cache
        self.kv_scales = {}
        if k_cache is not None and is_fp8(k_cache.dtype):
            scale = self.kv_scale if self.kv_scale is not None else torch.ones(1)
            self.kv_scale = scale.to(k_cache.device)
            self.kv_scales = {"kv_scale": self.kv_scale}

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                w_kv_b: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q_nope [T,H,dn], q_pe [T,H,dr] (rotated), kv_c [T,R] (normalized), k_pe [T,dr] (rotated),
        w_kv_b [H*(dn+dv), R] -> [T, H*dv]."""
        if self.k_cache is None:
            raise RuntimeError("MLA layer has no latent cache bound; the model runner allocates it")
        if self.kv_ready is not None:
            self.kv_ready()
        t = q_nope.shape[0]
        latent = torch.cat((kv_c, k_pe), dim=-1)
        if self.calibration is not None:  # the scale must cover this step's latents before they are stored
            self.calibration.observe_latent(self, latent, meta)
        self._store(latent, self.k_cache, meta.slot_mapping, **self.kv_scales)
        w = w_kv_b.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]
        out = q_nope.new_empty(t, self.num_heads, self.v_head_dim)
        nd = meta.num_decode_tokens
        if nd:
            q_lat = torch.einsum("bhd,hdr->bhr", q_nope[:nd], w_uk)
            o_lat = self._decode(torch.cat((q_lat, q_pe[:nd]), dim=-1), self.k_cache, meta.decode_block_tables,
                                 meta.decode_seq_lens, self.scale, self.kv_lora_rank, **self.kv_scales)
            out[:nd] = torch.einsum("bhr,hvr->bhv", o_lat, w_uv)
        if nd < t:
            q = torch.cat((q_nope[nd:], q_pe[nd:]), dim=-1)
            out[nd:] = self._prefill(q, self.k_cache, meta.prefill_cu_seqlens, meta.prefill_seq_lens,
                                     meta.prefill_block_tables, w_uk, w_uv, self.scale, **self.kv_scales)
        return out.reshape(t, self.num_heads * self.v_head_dim)


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek's attention block: low-rank q (or a plain q_proj), compressed kv, rope on a slice, MLA cache.

    Parameter names mirror the checkpoint (q_a_proj, q_a_layernorm, q_b_proj | q_proj, kv_a_proj_with_mqa,
    kv_a_layernorm, kv_b_proj, o_proj). Heads are split across tensor-parallel ranks; the low-rank down
    projections are replicated.
    """

    def __init__(self, cfg: PretrainedConfig, quant: Fp8BlockConfig | None = None, prefix: str = "",
                 backend: str = "torch") -> None:
        super().__init__()
        hidden, total_heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = divide(total_heads, get_tp_size())
        self.q_lora_rank = getattr(cfg, "q_lora_rank", None)
        self.kv_lora_rank, self.v_head_dim = cfg.kv_lora_rank, cfg.v_head_dim
        self.qk_nope_head_dim, self.qk_rope_head_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = bool(getattr(cfg, "attention_bias", False))

        def linear(kind: str, n_in: int, n_out: int, name: str, with_bias: bool = False) -> nn.Module:
            return make_linear(kind, n_in, n_out, bias=with_bias, quant=quant, prefix=f"{prefix}.{name}",
                               backend=backend)

        if self.q_lora_rank:
            self.q_a_proj = linear("replicated", hidden, self.q_lora_rank, "q_a_proj", bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, 1e-6, backend)
            self.q_b_proj = linear("column", self.q_lora_rank, total_heads * qk_head_dim, "q_b_proj")
        else:
            self.q_proj = linear("column", hidden, total_heads * qk_head_dim, "q_proj")
        self.kv_a_proj_with_mqa = linear("replicated", hidden, self.kv_lora_rank + self.qk_rope_head_dim,
                                         "kv_a_proj_with_mqa", bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, 1e-6, backend)
        self.kv_b_proj = linear("column", self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + self.v_head_dim),
                                "kv_b_proj")
        self.o_proj = linear("row", total_heads * self.v_head_dim, hidden, "o_proj", bias)

        cache, softmax_mult = rope_cache_and_mscale(cfg, self.qk_rope_head_dim)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        # V2 rotates interleaved pairs; V3 too unless rope_interleave is false (then halves, neox style)
        self.is_neox = getattr(cfg, "rope_interleave", True) is False
        self._rope = kernel("rope", backend)
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                 self.v_head_dim, qk_head_dim**-0.5 * softmax_mult, backend)
        self._w_kv_b: tuple[tuple[int, int, torch.dtype], torch.Tensor] | None = None

    def kv_b_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """kv_b_proj's weight in `dtype`; fp8 weights are dequantized once and kept until they change."""
        w = self.kv_b_proj.weight
        key = (w.data_ptr(), w._version, dtype)
        if self._w_kv_b is None or self._w_kv_b[0] != key:
            self._w_kv_b = (key, dense_weight(self.kv_b_proj).to(dtype))
        return self._w_kv_b[1]

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(t, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c.contiguous())
        q_pe, k_pe = self._rope(positions, q_pe.contiguous(), k_pe.reshape(t, 1, -1), self.cos_sin_cache,
                                self.is_neox)
        out = self.attn(q_nope, q_pe, kv_c, k_pe.reshape(t, -1), self.kv_b_weight(x.dtype), meta)
        return self.o_proj(out)
