"""Qwen2-MoE (q/k/v bias, a sigmoid-gated shared expert) and Qwen3-MoE (q/k RMSNorm, no shared expert).

Layer i is sparse unless it is listed in mlp_only_layers or falls between decoder_sparse_step strides; the
others get a dense MLP of intermediate_size. Routing is softmax top-k, renormalized when norm_topk_prob.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from appliance.layers.moe import GatedMLP, RouterConfig, SparseMoeBlock
from appliance.models.llama import LlamaAttention
from appliance.models.mixtral import MoECausalLM, MoEDecoderLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def _num_experts(cfg: PretrainedConfig) -> int:
    return int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0) or 0)


def is_sparse_layer(cfg: PretrainedConfig, index: int) -> bool:
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    only_dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    return index not in only_dense and _num_experts(cfg) > 0 and (index + 1) % step == 0


class Qwen2MoeForCausalLM(MoECausalLM):
    qk_norm = False

    def _qkv_bias(self) -> bool:
        return bool(getattr(self.config, "qkv_bias", True))

    def make_layer(self, index: int, backend: str) -> nn.Module:
        cfg = self.config
        act = getattr(cfg, "hidden_act", "silu")
        attn = LlamaAttention(cfg, self._qkv_bias(), self.qk_norm, backend)
        if not is_sparse_layer(cfg, index):
            return MoEDecoderLayer(cfg, attn, GatedMLP(cfg.hidden_size, cfg.intermediate_size, act,
                                                       backend=backend), backend)
        router = RouterConfig(num_experts=_num_experts(cfg), top_k=cfg.num_experts_per_tok,
                              renormalize=bool(getattr(cfg, "norm_topk_prob", False)))
        shared_size = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        shared = GatedMLP(cfg.hidden_size, shared_size, act, backend=backend) if shared_size else None
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, router, shared=shared,
                             shared_name="shared_expert", shared_gate=shared is not None, backend=backend,
                             moe_backend=self.moe_backend)
        return MoEDecoderLayer(cfg, attn, mlp, backend)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True

    def _qkv_bias(self) -> bool:
        return bool(getattr(self.config, "attention_bias", False))


MODELS: dict[str, type[nn.Module]] = {"Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
                                      "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM}
