"""GLM-4.5 / 4.6 / 4.7 (Glm4MoeForCausalLM): a Llama-shaped decoder with DeepSeek-V3's routing.

- Attention: q/k/v bias (attention_bias) but none on o_proj, optional q/k RMSNorm per head (use_qk_norm), partial
  rotary (rope_parameters.partial_rotary_factor, 0.5 in the released models) over the first dims, neox halves.
- The first `first_k_dense_replace` layers have a dense MLP; the rest route with DeepSeek-V3's router (sigmoid
  scores, e_score_correction_bias for the choice, n_group / topk_group, norm_topk_prob, routed_scaling_factor:
  layers/moe.py select_experts) and add n_shared_experts x moe_intermediate_size shared experts.
- The checkpoint's multi-token-prediction layer (layer index num_hidden_layers) is skipped at load: this build
  drafts with DeepSeek's MTP only.
"""
from __future__ import annotations

import re
from typing import Any

from torch import nn

from appliance.layers.moe import GatedMLP, RouterConfig, SparseMoeBlock
from appliance.models.llama import LlamaAttention
from appliance.models.mixtral import MoECausalLM, MoEDecoderLayer

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeForCausalLM(MoECausalLM):
    def rename(self, name: str) -> str | None:
        m = _LAYER_INDEX.match(name)
        if m is not None and int(m[1]) >= self.config.num_hidden_layers:
            return None  # the MTP layer
        return super().rename(name)

    def make_layer(self, index: int, backend: str) -> nn.Module:
        cfg = self.config
        act = getattr(cfg, "hidden_act", "silu")
        attn = LlamaAttention(cfg, bool(getattr(cfg, "attention_bias", False)),
                              bool(getattr(cfg, "use_qk_norm", False)), backend, o_bias=False)
        if index < int(getattr(cfg, "first_k_dense_replace", 0) or 0):
            return MoEDecoderLayer(cfg, attn, GatedMLP(cfg.hidden_size, cfg.intermediate_size, act, backend=backend),
                                   backend)
        return MoEDecoderLayer(cfg, attn, v3_moe_block(cfg, backend, self.moe_backend), backend)


def v3_moe_block(cfg: Any, backend: str, moe_backend: str) -> SparseMoeBlock:
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
