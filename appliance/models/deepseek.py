"""DeepSeek-V2 / V2-Lite / V3 / R1: multi-head latent attention, shared + routed experts, optional fp8 weights.

- The first `first_k_dense_replace` layers (and those off the moe_layer_freq stride) have a dense MLP; the
  rest route to experts and always add the shared experts (n_shared_experts x moe_intermediate_size).
- V2 routing: softmax, greedy top-k or group_limited_greedy (n_group / topk_group); V3 routing: sigmoid scores,
  e_score_correction_bias for the choice, groups ranked by their top-2 sum. Renormalized when norm_topk_prob,
  scaled by routed_scaling_factor.
- V3 checkpoints in fp8 (quantization_config with weight_block_size) load as fp8 weights + tile scales.
- V3's multi-token-prediction layers (num_nextn_predict_layers; stored as layers num_hidden_layers.. in the
  checkpoint) are loaded into `mtp`; speculative.algorithm = MTP drafts with them (mtp_forward / mtp_logits,
  executor/speculative.py), otherwise they are unused. A checkpoint without them (transformers drops them on
  save) leaves `mtp` empty.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from appliance.layers.attention import AttentionMetadata
from appliance.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from appliance.layers.fp8 import Fp8BlockConfig, ReplicatedLinear
from appliance.layers.mla import MultiHeadLatentAttention
from appliance.layers.moe import GatedMLP, RouterConfig, SparseMoeBlock
from appliance.layers.norm import RMSNorm
from appliance.models.mixtral import MoECausalLM, MoEDecoderLayer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")


def num_mtp_layers(cfg: PretrainedConfig) -> int:
    return int(getattr(cfg, "num_nextn_predict_layers", None) or getattr(cfg, "num_mtp_layers", 0) or 0)


class DeepseekMTPLayer(MoEDecoderLayer):
    """One multi-token-prediction step: combine the next token's embedding with the previous hidden state
    (enorm / hnorm, then eh_proj), run one decoder layer, and predict with its own norm and head."""

    def __init__(self, cfg: PretrainedConfig, attn: nn.Module, mlp: nn.Module, backend: str) -> None:
        super().__init__(cfg, attn, mlp, backend)
        hidden = cfg.hidden_size
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps, backend)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps, backend)
        self.eh_proj = ReplicatedLinear(2 * hidden, hidden)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(hidden, cfg.rms_norm_eps, backend)
        self.shared_head.head = ParallelLMHead(cfg.vocab_size, hidden)

    def predict(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states of the next-next token (before the head); needs a bound KV cache like any layer."""
        x = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(input_ids)), self.hnorm(previous_hidden)), dim=-1))
        h, residual = self(positions, x, None, meta)
        out, _ = self.shared_head.norm(h, residual)
        return out

    # ---- speculative decoding (executor/speculative.py) --------------------------------------------------
    def draft_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        """The layer's output before the head's norm: what the next draft step takes as previous_hidden (row i:
        the target's final hidden state at position i, or this layer's own, and the token at i + 1)."""
        x = self.eh_proj(torch.cat((self.enorm(self.embed_tokens(input_ids)), self.hnorm(previous_hidden)), dim=-1))
        h, residual = self(positions, x, None, meta)
        return h + residual

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of the token after next, from draft_hidden's rows."""
        return self.shared_head.head.compute_logits(self.shared_head.norm(hidden))


class DeepseekV2ForCausalLM(MoECausalLM):
    version = 2
    supports_fp8 = True
    piecewise_graphs = False  # MLA attention is not reached through Attention.attend, where the pieces break

    def __init__(self, hf_config: PretrainedConfig, backend: str = "torch", moe_backend: str | None = None) -> None:
        self.quant = Fp8BlockConfig.from_hf(hf_config)  # plain attribute: set before nn.Module init is fine
        super().__init__(hf_config, backend, moe_backend)
        n_mtp = num_mtp_layers(hf_config) if self.version == 3 else 0
        first = hf_config.num_hidden_layers
        self.mtp = nn.ModuleList(self._mtp_layer(first + i, backend) for i in range(n_mtp))

    # ---- multi-token prediction for speculative decoding (executor/speculative.py) -------------------------
    # The first MTP layer drafts every step of a chain (DeepSeek-V3 / R1 ship one), as SGLang and vLLM do.
    def mtp_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, previous_hidden: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
        """Draft rows (token at i + 1, hidden state at i) at positions i; returns the hidden states before the
        head's norm (the next draft step's previous_hidden)."""
        return self.mtp[0].draft_hidden(input_ids, positions, previous_hidden, meta)

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp[0].draft_logits(hidden)

    def mtp_attention_layers(self) -> list[nn.Module]:
        """The drafting MTP layer's latent-cache attention (its cache shares the model's block table); [] when
        the model has no MTP layer."""
        return [self.mtp[0].self_attn.attn] if len(self.mtp) else []

    @property
    def supports_cuda_graphs(self) -> bool:  # type: ignore[override]
        """Also needs the Triton MLA store and decode (the torch ones loop over sequences on the host)."""
        return self.moe_backend == "triton" and self.backend == "triton"

    # ---- construction ------------------------------------------------------------------------------------
    def _router(self) -> RouterConfig:
        cfg = self.config
        method = getattr(cfg, "topk_method", None) or ("noaux_tc" if self.version == 3 else "greedy")
        scoring = getattr(cfg, "scoring_func", None) or ("sigmoid" if method == "noaux_tc" else "softmax")
        grouped = method in ("group_limited_greedy", "noaux_tc")
        if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
            raise ValueError(f"DeepSeek topk_method {method!r} is not supported")
        return RouterConfig(num_experts=cfg.n_routed_experts, top_k=cfg.num_experts_per_tok, scoring=scoring,
                            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                            num_groups=int(cfg.n_group or 1) if grouped else 1,
                            topk_groups=int(cfg.topk_group or 1) if grouped else 1,
                            routed_scaling_factor=float(getattr(cfg, "routed_scaling_factor", 1.0) or 1.0))

    def _is_sparse(self, index: int) -> bool:
        cfg = self.config
        freq = int(getattr(cfg, "moe_layer_freq", 1) or 1)
        return (cfg.n_routed_experts or 0) > 0 and index >= (cfg.first_k_dense_replace or 0) and index % freq == 0

    def _parts(self, index: int, backend: str) -> tuple[nn.Module, nn.Module]:
        cfg, quant, prefix = self.config, self.quant, f"model.layers.{index}"
        act = getattr(cfg, "hidden_act", "silu")
        attn = MultiHeadLatentAttention(cfg, quant, f"{prefix}.self_attn", backend)
        if not self._is_sparse(index):
            return attn, GatedMLP(cfg.hidden_size, cfg.intermediate_size, act, quant, f"{prefix}.mlp", backend)
        n_shared = int(getattr(cfg, "n_shared_experts", 0) or 0)
        shared = (GatedMLP(cfg.hidden_size, cfg.moe_intermediate_size * n_shared, act, quant,
                           f"{prefix}.mlp.shared_experts", backend) if n_shared else None)
        router = self._router()
        mlp = SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, router,
                             correction_bias=router.scoring == "sigmoid", shared=shared, quant=quant, backend=backend,
                             moe_backend=self.moe_backend)
        return attn, mlp

    def make_layer(self, index: int, backend: str) -> nn.Module:
        attn, mlp = self._parts(index, backend)
        return MoEDecoderLayer(self.config, attn, mlp, backend)

    def _mtp_layer(self, index: int, backend: str) -> nn.Module:
        attn, mlp = self._parts(index, backend)
        return DeepseekMTPLayer(self.config, attn, mlp, backend)

    # ---- loading -----------------------------------------------------------------------------------------
    def rename(self, name: str) -> str | None:
        m = _LAYER.match(name)
        if m is None:
            return name
        index = int(m[1])
        first = self.config.num_hidden_layers
        if index < first:
            return name
        if index - first < len(self.mtp):
            return f"mtp.{index - first}.{m[2]}"
        return None  # MTP layers of a model built without them (V2, or num_nextn_predict_layers = 0)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        direct: set[str] = set()

        def split() -> Iterable[tuple[str, torch.Tensor]]:
            # attention and MTP-only tensors load one to one; the rest goes through the shared MoE loader
            # (llama's loader would read `q_proj` as a shard of a fused qkv projection)
            for name, tensor in weights:
                ours = self.rename(name)
                if ours is None:
                    continue
                if ".self_attn." in ours or (ours.startswith("mtp.") and ".mlp." not in ours):
                    if "rotary_emb.inv_freq" in ours:
                        continue
                    param = self._param(params, ours, name)
                    getattr(param, "weight_loader", _copy)(param, tensor)
                    direct.add(ours)
                else:
                    yield ours, tensor

        loaded = super().load_weights(split()) | direct
        if len(self.mtp) and not any(n.startswith("mtp.") for n in loaded):
            self.mtp = nn.ModuleList()  # the checkpoint has no MTP layers: nothing to keep
        return loaded


def _copy(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    version = 3


MODELS: dict[str, type[nn.Module]] = {"DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
                                      "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM}
