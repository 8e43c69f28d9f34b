"""MiniMax-M2 (MiniMaxM2ForCausalLM): Llama-shaped attention and a sigmoid-routed MoE.

- Attention: no biases; q and k are RMS-normalised over the whole projection (all heads at once, weights of
  num_heads x head_dim), before the heads are split and rotated; partial rotary (rotary_dim of head_dim).
- MoE: sigmoid scores, the choice made on scores + e_score_correction_bias, the chosen scores renormalised;
  every layer sparse, no shared experts. Checkpoint names: `block_sparse_moe` for the MoE block and its
  `e_score_correction_bias` beside the gate (moved under `gate` here).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from appliance.layers.attention import AttentionMetadata
from appliance.layers.moe import RouterConfig, SparseMoeBlock
from appliance.layers.norm import RMSNorm
from appliance.layers.parallel_state import get_tp_size
from appliance.models.llama import LlamaAttention
from appliance.models.mixtral import MoECausalLM, MoEDecoderLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MiniMaxM2Attention(LlamaAttention):
    def __init__(self, cfg: PretrainedConfig, backend: str) -> None:
        if get_tp_size() > 1:  # the q/k norm spans every head: its variance would need the other ranks' heads
            raise ValueError("MiniMax-M2 under tensor parallelism is not supported yet (its q/k norm spans all heads)")
        super().__init__(cfg, False, False, backend)
        eps = cfg.rms_norm_eps
        self.q_norm = RMSNorm(self.q_size, eps, backend)
        self.k_norm = RMSNorm(self.kv_size, eps, backend)
        self._rope_store = None  # the fused prologue norms per head

    def _unfused(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).reshape(t, self.num_heads, self.head_dim)
        k = self.k_norm(k).reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        return self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta)


class MiniMaxM2ForCausalLM(MoECausalLM):
    renames = ((".block_sparse_moe.", ".mlp."), (".mlp.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"))

    def make_layer(self, index: int, backend: str) -> nn.Module:
        cfg = self.config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        router = RouterConfig(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
                              renormalize=True)
        mlp = SparseMoeBlock(cfg.hidden_size, cfg.intermediate_size, router, correction_bias=True, backend=backend,
                             moe_backend=self.moe_backend)
        return MoEDecoderLayer(cfg, MiniMaxM2Attention(cfg, backend), mlp, backend)


MODELS: dict[str, type[nn.Module]] = {"MiniMaxM2ForCausalLM": MiniMaxM2ForCausalLM}
