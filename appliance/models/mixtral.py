"""Mixtral, and the mixture-of-experts decoder skeleton the other MoE families (qwen_moe, deepseek) build on.

A MoE decoder is the Llama decoder with a per-layer choice of feed-forward (a sparse expert block or a dense
MLP) and, for DeepSeek, a different attention. The skeleton reuses llama.py's forward passes and loader; this
module adds routing of per-expert checkpoint tensors (`...experts.{e}.{w1,w2,w3 | gate_proj,up_proj,down_proj}`
and transformers' fused 3-D `experts.gate_up_proj` / `experts.down_proj`) into the stacked expert weights.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from appliance.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from appliance.layers.fp8_scaled import SCALED_METHODS
from appliance.layers.moe import (
    EXPERT_NAME,
    EXPERT_SHARDS,
    FUSED_EXPERT_NAME,
    FusedMoE,
    RouterConfig,
    SparseMoeBlock,
)
from appliance.layers.norm import RMSNorm
from appliance.models.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class MoEDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm residual layer around any attention and any feed-forward (`mlp`)."""

    def __init__(self, cfg: PretrainedConfig, attn: nn.Module, mlp: nn.Module, backend: str) -> None:
        nn.Module.__init__(self)
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)


class MoEModel(LlamaModel):
    def __init__(self, cfg: PretrainedConfig, layers: list[nn.Module], backend: str) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)


class MoECausalLM(LlamaForCausalLM):
    """Base of the MoE families: subclasses say how layer i is built and how checkpoint names map onto ours."""

    renames: tuple[tuple[str, str], ...] = ()  # checkpoint name fragment -> ours
    is_moe = True  # the model runner passes moe_backend (backends.moe) to these
    # eager steps in pieces (executor/piecewise.py) when decode graphs are on, i.e. with the Triton fused MoE, whose
    # expert sort never syncs with the host at any token count (supports_cuda_graphs)
    piecewise_graphs = True
    supports_fp8 = False  # block-fp8 checkpoints: DeepSeek only so far (its layers are built through fp8.py)

    def __init__(self, hf_config: PretrainedConfig, backend: str = "torch", moe_backend: str | None = None) -> None:
        nn.Module.__init__(self)
        qc = getattr(hf_config, "quantization_config", None) or {}
        method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
        # per-tensor / per-channel fp8 (layers/fp8_scaled.py) swaps this family's layers after it is built
        if not self.supports_fp8 and qc and method not in SCALED_METHODS:
            raise ValueError(f"{type(self).__name__}: {method} checkpoints are not supported for this family yet "
                             "(compressed-tensors and ModelOpt fp8 are; block fp8 works for DeepSeek-V2/V3)")
        self.config = hf_config
        self.backend = backend
        self.moe_backend = moe_backend or backend  # the fused_moe kernels
        layers = [self.make_layer(i, backend) for i in range(hf_config.num_hidden_layers)]
        self.model = MoEModel(hf_config, layers, backend)
        self.lm_head = ParallelLMHead.of_model(hf_config, self.model.embed_tokens)
        self.tie_word_embeddings = self.lm_head.tied

    @property
    def supports_cuda_graphs(self) -> bool:  # type: ignore[override]
        """Decode is capturable with the Triton fused MoE (its expert sort never syncs with the host); the torch
        reference loops over the experts it finds on the host."""
        return self.moe_backend == "triton"

    def make_layer(self, index: int, backend: str) -> nn.Module:
        raise NotImplementedError

    def rename(self, name: str) -> str | None:
        """Our parameter name for a checkpoint name; None skips the tensor."""
        for src, dst in self.renames:
            name = name.replace(src, dst)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        loaded |= super().load_weights(self._route_experts(weights, loaded))
        return loaded

    def _route_experts(self, weights: Iterable[tuple[str, torch.Tensor]],
                       loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Load expert tensors into the stacked weights (noting them in `loaded`); yield everything else."""
        for ckpt_name, tensor in weights:
            name = self.rename(ckpt_name)
            if name is None:
                continue
            m = EXPERT_NAME.match(name)
            if m is not None:
                moe = self._experts(m["prefix"], ckpt_name)
                if m["kind"] == "input_scale" and moe.w13_weight_scale is not None:
                    continue  # fp8 experts run weight-only (layers/fp8_scaled.py): static input scales go unused
                stacked, shard = EXPERT_SHARDS[m["proj"]]
                target = f"{stacked}_{m['kind']}"
                param = getattr(moe, target, None)
                if param is None:
                    raise KeyError(f"checkpoint tensor {ckpt_name!r} has no matching parameter (is the model fp8?)")
                moe.load_expert(param, tensor, int(m["expert"]), shard)
                loaded.add(f"{m['prefix']}.{target}")
                continue
            m = FUSED_EXPERT_NAME.match(name)
            if m is not None:
                self._experts(m["prefix"], ckpt_name).load_fused(m["proj"], tensor)
                loaded.add(f"{m['prefix']}.{'w2' if m['proj'] == 'down_proj' else 'w13'}_weight")
                continue
            yield name, tensor

    def _experts(self, prefix: str, source: str) -> FusedMoE:
        try:
            module = self.get_submodule(prefix)
        except AttributeError as exc:
            raise KeyError(f"checkpoint tensor {source!r} has no matching expert layer in the model") from exc
        if not isinstance(module, FusedMoE):
            raise KeyError(f"checkpoint tensor {source!r} names experts, but {prefix} is not an expert layer")
        return module


class MixtralForCausalLM(MoECausalLM):
    renames = ((".block_sparse_moe.", ".mlp."),)

    def make_layer(self, index: int, backend: str) -> nn.Module:
        cfg = self.config
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
        router = RouterConfig(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok, renormalize=True)
        mlp = SparseMoeBlock(cfg.hidden_size, cfg.intermediate_size, router, backend=backend,
                             moe_backend=self.moe_backend)
        return MoEDecoderLayer(cfg, LlamaAttention(cfg, False, False, backend), mlp, backend)


MODELS: dict[str, type[nn.Module]] = {"MixtralForCausalLM": MixtralForCausalLM}
