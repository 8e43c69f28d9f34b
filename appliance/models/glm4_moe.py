"""GLM-4.5 / 4.6 / 4.7 (Glm4MoeForCausalLM): a Llama-shaped decoder with DeepSeek-V3's routing.

- Attention: q/k/v bias (attention_bias) but none on o_proj, optional q/k RMSNorm per head (use_qk_norm), partial
  rotary (rope_parameters.partial_rotary_factor, 0.5 in the released models) over the first dims, neox halves.
- The first `first_k_dense_replace` layers have a dense MLP; the rest route with DeepSeek-V3's router (sigmoid
  scores, e_score_correction_bias for the choice, n_group / topk_group, norm_topk_prob, routed_scaling_factor:
  layers/moe.py select_experts) and add n_shared_experts x moe_intermediate_size shared experts.
- The checkpoint's multi-token-prediction layer (layer num_hidden_layers, num_nextn_predict_layers of them) is
  DeepSeek's MTP layer around a GLM decoder layer; loaded into `mtp`, it drafts for speculative.algorithm = MTP
  (deepseek.MtpDrafter). A checkpoint without it (transformers drops it on save) leaves `mtp` empty.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from appliance.layers.moe import GatedMLP, RouterConfig, SparseMoeBlock
from appliance.models.deepseek import DeepseekMTPLayer, MtpDrafter, num_mtp_layers
from appliance.models.llama import LlamaAttention
from appliance.models.mixtral import MoECausalLM, MoEDecoderLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Glm4MoeForCausalLM(MtpDrafter, MoECausalLM):
    def __init__(self, hf_config: PretrainedConfig, backend: str = "torch", moe_backend: str | None = None) -> None:
        super().__init__(hf_config, backend, moe_backend)
        self.mtp = nn.ModuleList(
            DeepseekMTPLayer(hf_config, self._attention(backend), v3_moe_block(hf_config, backend, self.moe_backend),
                             backend) for _ in range(num_mtp_layers(hf_config)))

    def rename(self, name: str) -> str | None:
        ours = self.mtp_name(name, self.config.num_hidden_layers)
        return None if ours is None else super().rename(ours)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        if len(self.mtp) and not any(n.startswith("mtp.") for n in loaded):
            self.mtp = nn.ModuleList()  # the checkpoint has no MTP layer: nothing to keep
        return loaded

    def _attention(self, backend: str) -> LlamaAttention:
        cfg = self.config
        return LlamaAttention(cfg, bool(getattr(cfg, "attention_bias", False)),
                              bool(getattr(cfg, "use_qk_norm", False)), backend, o_bias=False)

    def make_layer(self, index: int, backend: str) -> nn.Module:
        cfg = self.config
        act = getattr(cfg, "hidden_act", "silu")
        attn = self._attention(backend)
        if index < int(getattr(cfg, "first_k_dense_replace", 0) or 0):
            return MoEDecoderLayer(cfg, attn, GatedMLP(cfg.hidden_size, cfg.intermediate_size, act, backend=backend),
                                   backend)
        return MoEDecoderLayer(cfg, attn, v3_moe_block(cfg, backend, self.moe_backend), backend)


def v3_moe_block(cfg: PretrainedConfig, backend: str, moe_backend: str) -> SparseMoeBlock:
    """Sigmoid-scored grouped routing with a correction bias, plus shared experts (DeepSeek-V3's layout)."""
    act = getattr(cfg, "hidden_act", "silu")
    router = RouterConfig(num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring="sigmoid",
                          renormalize=bool(getattr(cfg, "norm_topk_prob", True)),
                          num_groups=int(getattr(cfg, "n_group", 1) or 1),
                          topk_groups=int(getattr(cfg, "topk_group", 1) or 1),
                          routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0))
    n_shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
    shared = GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared, act, backend=backend) if n_shared else None
    return SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, router, correction_bias=True, shared=shared,
                          backend=backend, moe_backend=moe_backend)


MODELS: dict[str, type[nn.Module]] = {"Glm4MoeForCausalLM": Glm4MoeForCausalLM}
