"""Gemma 3 text (Gemma3ForCausalLM; the text half of Gemma3ForConditionalGeneration checkpoints).

What sets it apart from the Llama decoder it is built from:
- `layer_types`: local layers attend over a sliding window of `sliding_window` tokens, global layers over the
  whole context (5 local to 1 global in the released models), each kind with its own rotary parameters
  (`rope_parameters[layer_type]`: theta 10k local, 1M global, linear scaling on 27B's global layers);
- q/k RMSNorm per head, softmax scale query_pre_attn_scalar^-0.5;
- four norms per layer (after attention and around the MLP), all of them Gemma's (1 + weight) RMSNorm; the
  output norm of attention and of the MLP, the residual add after it and the norm after that run as one
  `norm_add_norm` op (two launches a layer where four norms and two adds would be six ops);
- embeddings scaled by sqrt(hidden_size) (in the model's dtype, as transformers does), tied to the LM head;
- a GeGLU MLP (gelu, tanh approximation); an optional final logit soft-cap.

Gemma3ForConditionalGeneration checkpoints (the released 4B-27B) are served text-only: the loader hands over their
text_config (executor/model_loader.py) and the vision tower's tensors are skipped.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from appliance.layers.activation import GatedActivation
from appliance.layers.attention import Attention, AttentionMetadata
from appliance.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from appliance.layers.kernels import kernel
from appliance.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from appliance.layers.norm import GemmaRMSNorm
from appliance.models.layer_types import SLIDING, layer_types
from appliance.models.llama import LlamaAttention, LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig


def layer_rope(cfg: PretrainedConfig, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) of one layer kind, from transformers' per-layer-type rope_parameters."""
    params = (getattr(cfg, "rope_parameters", None) or {}).get(layer_type)
    if not isinstance(params, dict) or "rope_theta" not in params:
        raise ValueError(f"rope_parameters has no entry for {layer_type!r} layers")
    return float(params["rope_theta"]), None if params.get("rope_type", "default") == "default" else dict(params)


class GemmaMLP(nn.Module):
    def __init__(self, cfg: PretrainedConfig, backend: str) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], bias=False)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=False)
        self.act = GatedActivation(act, backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, layer_type: str, backend: str) -> None:
        super().__init__()
        if getattr(cfg, "attn_logit_softcapping", None) is not None:
            raise ValueError("attn_logit_softcapping is not supported (Gemma 3 ships without it)")
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (encoder use) is not supported: this is a causal decoder")
        window = int(cfg.sliding_window) if layer_type == SLIDING else None
        self.self_attn = LlamaAttention(cfg, bool(getattr(cfg, "attention_bias", False)), True, backend,
                                        sliding_window=window, scale=float(cfg.query_pre_attn_scalar) ** -0.5,
                                        rope=layer_rope(cfg, layer_type), norm=GemmaRMSNorm)
        self.mlp = GemmaMLP(cfg, backend)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, backend)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, backend)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, backend)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, backend)
        self.eps = eps
        self._norm_add_norm = kernel("norm_add_norm", backend)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor, meta: AttentionMetadata,
                next_norm: GemmaRMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """h: this layer's input already through input_layernorm (the layer before applied it in its last
        norm_add_norm). Returns (next_norm's output, the residual stream): each sandwich norm's output norm, its
        residual add and the norm after it are one norm_add_norm."""
        h, residual = self._norm_add_norm(self.self_attn(positions, h, meta), self.post_attention_layernorm.weight,
                                          residual, self.pre_feedforward_layernorm.weight, self.eps)
        return self._norm_add_norm(self.mlp(h), self.post_feedforward_layernorm.weight, residual,
                                   next_norm.weight, self.eps)


class Gemma3Model(nn.Module):
    def __init__(self, cfg: PretrainedConfig, backend: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, kind, backend) for kind in layer_types(cfg))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = x * torch.tensor(self.embed_scale, dtype=x.dtype)  # rounded to the dtype first, like transformers
        h = self.layers[0].input_layernorm(residual)
        # each layer ends in the next layer's input norm (the last one's: the final norm)
        nexts = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, nexts):
            h, residual = layer(positions, h, residual, meta, next_norm)
        return h


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Loads through LlamaForCausalLM.load_weights (q/k/v and gate/up fused); GemmaRMSNorm loads 1 + weight."""

    supports_cuda_graphs = True
    piecewise_graphs = True
    sliding_window_attention = True  # windows are applied, so max_model_len is not capped at sliding_window

    def __init__(self, hf_config: PretrainedConfig, backend: str = "torch") -> None:
        nn.Module.__init__(self)
        self.config = hf_config
        self.model = Gemma3Model(hf_config, backend)
        self.lm_head = ParallelLMHead.of_model(hf_config, self.model.embed_tokens, tie_default=True)
        self.tie_word_embeddings = self.lm_head.tied
        self.softcap = getattr(hf_config, "final_logit_softcapping", None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a multimodal Gemma 3 checkpoint: `language_model.model.*` (as released) or
    `model.language_model.*` (as transformers 5 saves it); vision tower and projector skipped."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._text_tensors(weights))

    @staticmethod
    def _text_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for prefix, ours in (("language_model.model.", "model."), ("model.language_model.", "model."),
                                 ("language_model.lm_head.", "lm_head.")):
                if name.startswith(prefix):
                    yield ours + name[len(prefix):], tensor
                    break
            else:
                if name.startswith("lm_head."):
                    yield name, tensor
                # anything else belongs to the vision tower or its projector


MODELS: dict[str, type[nn.Module]] = {"Gemma3ForCausalLM": Gemma3ForCausalLM,
                                      "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration}
