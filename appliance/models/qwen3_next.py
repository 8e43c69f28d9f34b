"""Qwen3-Next and the Qwen3.5 text models (dense and MoE): a hybrid of Gated DeltaNet linear-attention layers (layers/gated_delta_net.py) and gated full
attention layers (`config.layer_types`), with a routed MoE plus a sigmoid-gated shared expert (or a dense MLP in
mlp_only_layers).

Differences from the Qwen MoE decoder: every RMSNorm outside the linear-attention layers scales by 1 + weight
(zero-centred weights); full attention projects q and an output gate together (q_proj is [H, 2D] per head: q,
then the gate), multiplies the attention output by sigmoid(gate), normalises q and k per head and rotates only
the first partial_rotary_factor of each head. Linear-attention layers keep their state in the runner's state
cache (executor/state_cache.py) instead of KV blocks. Qwen3.5 differs only in its linear-attention input
projections (one per output instead of Qwen3-Next's two grouped ones); its text rotary (mrope) equals plain
partial rotary for text, where the three position grids coincide.

The multi-token-prediction layer (`mtp.*`, `HybridMtp`) is built only when speculative.algorithm = MTP and drafts
through executor/speculative_mtp.py (executor/speculative_states.py repairs the recurrent state after a rejected
draft). Tensor parallelism splits the linear-attention heads (layers/gated_delta_net.py).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from appliance.layers.attention import Attention, AttentionMetadata
from appliance.layers.embedding import VocabParallelEmbedding
from appliance.layers.gated_delta_net import GatedDeltaNet, StateCacheSpec
from appliance.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from appliance.layers.moe import GatedMLP, RouterConfig, SparseMoeBlock
from appliance.layers.norm import RMSNorm
from appliance.layers.rotary import RotaryEmbedding, rope_parameters
from appliance.models.llama import LlamaModel
from appliance.models.mixtral import MoECausalLM
from appliance.models.qwen_moe import is_sparse_layer

LINEAR, FULL = "linear_attention", "full_attention"


class OffsetRMSNorm(RMSNorm):
    """RMSNorm scaling by 1 + weight (weights stored zero-centred)."""

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._op(x, 1.0 + self.weight, self.eps, residual)


def partial_rotary_factor(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        return float(params["partial_rotary_factor"])
    return float(getattr(cfg, "partial_rotary_factor", 1.0))


class GatedAttention(nn.Module):
    def __init__(self, cfg: Any, backend: str) -> None:
        super().__init__()
        hidden, n_heads = cfg.hidden_size, cfg.num_attention_heads
        n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // n_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        # q_proj is 2H heads of D (each head's q, then its gate), so the q shard splits whole heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, 2 * n_heads, n_kv, bias=bias)
        self.o_proj = RowParallelLinear(n_heads * self.head_dim, hidden, bias=bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads // 2, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        theta, scaling = rope_parameters(cfg)
        rotary_dim = int(self.head_dim * partial_rotary_factor(cfg))
        self.rotary = RotaryEmbedding(self.head_dim, rotary_dim, cfg.max_position_embeddings, theta, scaling,
                                      is_neox=True, backend=backend)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps, backend)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps, backend)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        qg, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, gate = qg.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class HybridDecoderLayer(nn.Module):
    """Pre-norm residual layer around a token mixer (`linear_attn` or `self_attn`) and a feed-forward."""

    def __init__(self, cfg: Any, kind: str, mlp: nn.Module, backend: str, split_projections: bool) -> None:
        super().__init__()
        self.kind = kind
        if kind == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, backend, split_projections)
        else:
            self.self_attn = GatedAttention(cfg, backend)
        self.mlp = mlp
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        mixer = self.linear_attn if self.kind == LINEAR else self.self_attn
        h = mixer(positions, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class HybridMtp(nn.Module):
    """The multi-token-prediction layer (checkpoint `mtp.*`): the draft token's embedding and the previous hidden
    state, each RMS-normed, concatenated and projected by fc, one gated full-attention decoder layer, a final norm;
    the model's embedding and LM head are shared. Speculative decoding (speculative.algorithm = MTP) drafts with it."""

    def __init__(self, cfg: Any, layer: nn.Module, backend: str) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = ColumnParallelLinear(2 * hidden, hidden, gather_output=True)  # every rank needs all of it
        self.pre_fc_norm_embedding = OffsetRMSNorm(hidden, eps, backend)
        self.pre_fc_norm_hidden = OffsetRMSNorm(hidden, eps, backend)
        self.layers = nn.ModuleList([layer])
        self.norm = OffsetRMSNorm(hidden, eps, backend)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(previous_hidden)], dim=-1)
        h, residual = self.layers[0](positions, self.fc(x), None, meta)
        return self.norm(h, residual)[0]


def num_mtp_layers(cfg: Any) -> int:
    """MTP layers a config declares (Qwen3-Next: num_nextn_predict_layers, Qwen3.5: mtp_num_hidden_layers)."""
    return int(getattr(cfg, "num_nextn_predict_layers", 0) or getattr(cfg, "mtp_num_hidden_layers", 0) or 0)


class HybridModel(LlamaModel):
    def __init__(self, cfg: Any, layers: list[nn.Module], backend: str) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)


class Qwen3NextForCausalLM(MoECausalLM):
    split_projections = False  # Qwen3.5: separate in_proj_qkv / _z / _b / _a
    # decode graphs as MoECausalLM decides (the state update never syncs with the host: its slots are the rows'
    # device table rows); no piecewise graphs, whose pieces would capture the prefill kernels' host loops
    piecewise_graphs = False

    builds_mtp_on_request = True  # model_loader passes with_mtp: the MTP layer is built only to draft with

    def __init__(self, hf_config: Any, backend: str = "torch", moe_backend: str | None = None,
                 with_mtp: bool = False) -> None:
        kinds = list(hf_config.layer_types)
        if set(kinds) - {LINEAR, FULL}:
            raise ValueError(f"layer_types {sorted(set(kinds) - {LINEAR, FULL})} are not supported "
                             f"(supported: {LINEAR}, {FULL})")
        super().__init__(hf_config, backend, moe_backend)
        self.model = HybridModel(hf_config, list(self.model.layers), backend)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self.mtp: HybridMtp | None = None
        if with_mtp and num_mtp_layers(hf_config):  # the first MTP layer drafts every step (as vLLM's)
            layer = HybridDecoderLayer(hf_config, FULL, self._mlp(0, backend), backend, self.split_projections)
            self.mtp = HybridMtp(hf_config, layer, backend)

    def rename(self, name: str) -> str | None:
        if name.startswith("mtp."):  # built only for speculative.algorithm = MTP, with its first layer only
            keep = self.mtp is not None and (not name.startswith("mtp.layers.") or name.startswith("mtp.layers.0."))
            return name if keep else None
        return super().rename(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        if self.mtp is not None and not any(n.startswith("mtp.") for n in loaded):
            raise ValueError(f"speculative.algorithm=MTP: the checkpoint has no MTP layer (mtp.*) for "
                             f"{type(self).__name__} to draft with (transformers' save_pretrained drops it)")
        return loaded

    # ---- speculative decoding with the MTP layer (executor/speculative_mtp.py) ----------------------------
    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        """Draft rows (token at i + 1, hidden state at i) at positions i; returns the normed hidden states (the
        next draft step's previous_hidden, and the LM head's input)."""
        assert self.mtp is not None
        return self.mtp(self.model.embed_tokens(input_ids), positions, previous_hidden, meta)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden)

    def mtp_attention_layers(self) -> list[Attention]:
        return [self.mtp.layers[0].self_attn.attn] if self.mtp is not None else []

    def make_layer(self, index: int, backend: str) -> nn.Module:
        return HybridDecoderLayer(self.config, self.config.layer_types[index], self._mlp(index, backend), backend,
                                  self.split_projections)

    def _mlp(self, index: int, backend: str) -> nn.Module:
        cfg = self.config
        act = getattr(cfg, "hidden_act", "silu")
        if not is_sparse_layer(cfg, index):
            mlp: nn.Module = GatedMLP(cfg.hidden_size, cfg.intermediate_size, act, backend=backend)
        else:
            norm_topk = getattr(cfg, "norm_topk_prob", None)  # Qwen3.5-MoE's config has none: it renormalizes
            router = RouterConfig(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                                  renormalize=norm_topk is None or bool(norm_topk))
            shared_size = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
            shared = GatedMLP(cfg.hidden_size, shared_size, act, backend=backend) if shared_size else None
            mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, router, shared=shared,
                                 shared_name="shared_expert", shared_gate=shared is not None, backend=backend,
                                 moe_backend=self.moe_backend)
        return mlp

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers if layer.kind == FULL]

    def state_layers(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.model.layers if layer.kind == LINEAR]

    def state_cache_spec(self, conv_dtype: torch.dtype, state_dtype: torch.dtype = torch.float32) -> StateCacheSpec:
        layer = self.state_layers()[0]
        return StateCacheSpec(len(self.state_layers()), layer.conv_dim, layer.conv_kernel_size - 1,
                              layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, conv_dtype, state_dtype)


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """Qwen3.5 text models: dense (Qwen3_5ForCausalLM) and MoE (Qwen3_5MoeForCausalLM; the layers follow the
    config: experts where num_experts > 0)."""

    split_projections = True


MODELS: dict[str, type[nn.Module]] = {"Qwen3NextForCausalLM": Qwen3NextForCausalLM,
                                      "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
                                      "Qwen3_5MoeForCausalLM": Qwen3_5ForCausalLM}
