"""EAGLE draft heads (executor/speculative_draft.py drives them), in the checkpoint layouts people publish.

EAGLE-3 (`LlamaForCausalLMEagle3`; the heads published for Llama-3.x, Qwen3 and gpt-oss targets share it):
- `fc` [H, 3 * target H]: the target's hidden states captured after three of its layers, concatenated;
- one decoder layer (`midlayer.*`, or `layers.0.*` in the speculators format) whose attention takes
  [input_layernorm(embed(token)), hidden_norm(hidden)] of width 2H; the residual is the hidden input;
- `norm`, and `lm_head` [draft_vocab_size, H] with `d2t` (draft id -> target id offset: target = d + d2t[d]);
  `t2d` is not needed. `embed_tokens` is the target's when the checkpoint has none.
Row i takes the token at i + 1 and the hidden state at i; the next chain step takes the layer's output before
`norm` (what the head was trained on), the logits the normed output.

EAGLE (`LlamaForCausalLMEagle`, EAGLE-1 layout): `fc` [H, 2H] (+ bias) over [embed(token), target's last
hidden state], then the decoder layers (the first without input_layernorm); the target's LM head scores it.

The target's capture: `AuxCapture` copies the chosen layers' outputs (hidden + residual) into one buffer during
the target's forward (models/llama.py); a fixed buffer, so CUDA graphs replay the copies too.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from appliance.layers.attention import Attention, AttentionMetadata
from appliance.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from appliance.layers.linear import ColumnParallelLinear, QKVParallelLinear
from appliance.layers.norm import RMSNorm
from appliance.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "Eagle3Speculator")
EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "EagleLlamaForCausalLM", "EagleSpeculator")


def default_capture_layers(num_layers: int) -> list[int]:
    """EAGLE-3's usual choice: the outputs of layers 1, n/2 - 1 and n - 4 (the inputs of 2, n/2 and n - 3)."""
    return [1, num_layers // 2 - 1, num_layers - 4] if num_layers > 4 else [0, num_layers // 2, num_layers - 1]


class AuxCapture:
    """The outputs of `layers` (indices into the target's decoder layers) for the rows of the last forward,
    side by side: [rows, len(layers) * H]."""

    def __init__(self, layers: list[int], hidden_size: int, rows: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.slots: dict[int, list[int]] = {}  # a layer may be listed twice
        for i, layer in enumerate(layers):
            self.slots.setdefault(layer, []).append(i)
        self.hidden_size = hidden_size
        self.buffer = torch.zeros(rows, len(layers) * hidden_size, dtype=dtype, device=device)

    def write(self, layer: int, x: torch.Tensor, residual: torch.Tensor) -> None:
        slots = self.slots.get(layer)
        if slots is None:
            return
        n = x.shape[0]
        if n > self.buffer.shape[0]:
            if x.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"EAGLE-3 capture buffer of {self.buffer.shape[0]} rows met a captured step of {n}")
            self.buffer = torch.zeros(n, self.buffer.shape[1], dtype=self.buffer.dtype, device=self.buffer.device)
        h = self.hidden_size
        out = x + residual
        for slot in slots:
            self.buffer[:n, slot * h : (slot + 1) * h].copy_(out)

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.buffer[index]


class _Eagle3Layer(LlamaDecoderLayer):
    def __init__(self, cfg: Any, backend: str) -> None:
        super().__init__(cfg, False, False, backend)
        attn: LlamaAttention = self.self_attn
        # the attention reads [embeds, hidden]: twice the width
        attn.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, attn.head_dim, cfg.num_attention_heads,
                                          attn.qkv_proj.total_num_kv_heads, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def sole_readers(self) -> list[tuple[nn.Module, nn.Module]]:
        """forward_eagle concatenates the input norm's output with the hidden norm's: the MLP's norm only."""
        return [(self.post_attention_layernorm, self.mlp.gate_up_proj)]

    def forward_eagle(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                      meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x), residual


class Eagle3Head(nn.Module):
    def __init__(self, cfg: Any, target_cfg: Any, backend: str = "torch") -> None:
        super().__init__()
        h = cfg.hidden_size
        target_h = int(getattr(cfg, "target_hidden_size", None) or target_cfg.hidden_size)
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(target_cfg.vocab_size, h)
        self.fc = ColumnParallelLinear(3 * target_h, h, bias=False, gather_output=True)
        self.layers = nn.ModuleList([_Eagle3Layer(cfg, backend)])
        self.norm = RMSNorm(h, cfg.rms_norm_eps, backend)
        self.draft_vocab_size = int(getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, h)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64), persistent=False)

    tie_word_embeddings = False  # read by the Llama loader (_load)
    supports_cuda_graphs = True  # Llama layers; never syncs with the host (executor/draft_graphs.py)
    _param = staticmethod(LlamaForCausalLM._param)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed output for the logits, pre-norm output for the next chain step); `hidden` is the target's
        captured states (3 * target H: through fc) or the previous step's pre-norm output (H)."""
        if hidden.shape[-1] != self.norm.weight.shape[0]:
            hidden = self.fc(hidden)
        x, residual = self.layers[0].forward_eagle(positions, self.embed_tokens(input_ids), hidden, meta)
        return self.norm(x, residual)

    def target_ids(self) -> torch.Tensor:
        """The target's token id of each id of the head's vocabulary (d + d2t[d])."""
        return torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t

    def attention_layers(self) -> list[Attention]:
        return [self.layers[0].self_attn.attn]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        renamed: list[tuple[str, torch.Tensor]] = []
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "d2t":
                self.d2t.copy_(tensor.to(torch.int64))
            elif name != "t2d":
                renamed.append(("layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.")
                                else name, tensor))
        return _load(self, renamed)


class _PassResidual(nn.Module):
    """EAGLE-1's first layer has no input norm; it keeps the decoder layer's (x) / (x, residual) interface."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return x if residual is None else (x + residual, x + residual)


class EagleHead(nn.Module):
    """EAGLE-1: fc over [embeds, target's last hidden state], Llama decoder layers, the target's LM head."""

    def __init__(self, cfg: Any, target_cfg: Any, backend: str = "torch") -> None:
        super().__init__()
        h = cfg.hidden_size
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(target_cfg.vocab_size, h)
        bias = bool(getattr(cfg, "bias", True))
        self.fc = ColumnParallelLinear(2 * h, h, bias=bias, gather_output=True)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, False, False, backend)
                                    for _ in range(cfg.num_hidden_layers))
        self.layers[0].input_layernorm = _PassResidual()

    tie_word_embeddings = False
    supports_cuda_graphs = True
    _param = staticmethod(LlamaForCausalLM._param)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.fc(torch.cat([self.embed_tokens(input_ids), hidden], dim=-1))
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        out = x + residual
        return out, out

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return _load(self, [(name.removeprefix("model."), tensor) for name, tensor in weights])


def _load(head: nn.Module, weights: list[tuple[str, torch.Tensor]]) -> set[str]:
    """The Llama loader (fused q/k/v and gate/up) over the head's own parameter names, which follow the
    checkpoint's (`layers.i.*`, fc, norm, lm_head, embed_tokens)."""
    return LlamaForCausalLM.load_weights(head, weights)  # type: ignore[arg-type]


def head_class(cfg: Any) -> type[nn.Module] | None:
    """The EAGLE head class of a draft config's architectures, None for an ordinary model."""
    archs = tuple(getattr(cfg, "architectures", None) or ())
    if any(a in EAGLE3_ARCHITECTURES for a in archs):
        return Eagle3Head
    if any(a in EAGLE_ARCHITECTURES for a in archs):
        return EagleHead
    return None


