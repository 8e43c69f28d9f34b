"""The Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3) built from tensor-parallel layers.

The family differs in two switches read from the HF config: a bias on the q/k/v projections (Qwen2) and an
RMSNorm over each head of q and k before rotary (Qwen3). Parameter names mirror the HF checkpoint except the
fused `qkv_proj` and `gate_up_proj`, which `load_weights` fills from the separate checkpoint tensors.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from appliance.layers.activation import SiluAndMul
from appliance.layers.attention import Attention, AttentionMetadata, fused_rope_store
from appliance.layers.decode_chain import DecodeChain
from appliance.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from appliance.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from appliance.layers.norm import RMSNorm
from appliance.layers.rotary import RotaryEmbedding, rope_parameters

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from appliance.kernels.fp8_gemm import QuantizedAct

# checkpoint name fragment -> (our fused parameter fragment, shard id)
_STACKED = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


def partial_rotary_factor(cfg: PretrainedConfig) -> float:
    """The share of head_dim that rotates: transformers 5 keeps it in rope_parameters, older configs at the top
    (MiniMax-M2 checkpoints as rotary_dim)."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
        return float(params["partial_rotary_factor"])
    if getattr(cfg, "partial_rotary_factor", None) is not None:
        return float(cfg.partial_rotary_factor)
    rotary_dim = getattr(cfg, "rotary_dim", None)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return float(rotary_dim) / head_dim if rotary_dim else 1.0


class LlamaAttention(nn.Module):
    def __init__(self, cfg: PretrainedConfig, qkv_bias: bool, qk_norm: bool, backend: str, *,
                 sliding_window: int | None = None, sinks: bool = False, scale: float | None = None,
                 rope: tuple[float, dict[str, Any] | None] | None = None, norm: type[RMSNorm] = RMSNorm,
                 o_bias: bool | None = None) -> None:
        """The keywords serve the families built on this attention: a per-layer sliding window and attention sinks
        (gpt-oss, Gemma 3), a softmax scale other than head_dim^-0.5 and per-layer rotary (theta, scaling) (Gemma 3),
        the q/k norm's class (Gemma's 1 + weight), o_proj's bias when it is not attention_bias (GLM-4.5)."""
        super().__init__()
        hidden = cfg.hidden_size
        n_heads = cfg.num_attention_heads
        n_kv = getattr(cfg, "num_key_value_heads", None) or n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or hidden // n_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_dim, n_heads, n_kv, bias=qkv_bias)
        # Llama/Qwen3 put `attention_bias` on o_proj too; Qwen2's q/k/v bias never reaches o_proj
        if o_bias is None:
            o_bias = bool(getattr(cfg, "attention_bias", False))
        self.o_proj = RowParallelLinear(n_heads * self.head_dim, hidden, bias=o_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        theta, scaling = rope if rope is not None else rope_parameters(cfg)
        rotary_dim = int(self.head_dim * partial_rotary_factor(cfg))
        self.rotary = RotaryEmbedding(self.head_dim, rotary_dim, cfg.max_position_embeddings, theta, scaling,
                                      is_neox=True, backend=backend)
        eps = cfg.rms_norm_eps
        self.q_norm = norm(self.head_dim, eps, backend) if qk_norm else None
        self.k_norm = norm(self.head_dim, eps, backend) if qk_norm else None
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads,
                              self.head_dim**-0.5 if scale is None else scale, backend,
                              sliding_window=sliding_window, sinks=sinks)
        # norm + rotary + KV store in one launch when the attention backend has it; the modules above keep
        # owning the parameters (checkpoint names, loading) and serve the unfused path
        self._rope_store = fused_rope_store(backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor | QuantizedAct,
                meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self._rope_store is None or self.attn.calibration is not None:  # calibration observes post-rope keys
            return self.o_proj(self._unfused(positions, qkv, meta))
        k_cache, v_cache = self.attn.kv_cache()
        qn, kn = self.q_norm, self.k_norm
        slots = self.attn.group_meta(meta).slot_mapping  # its KV cache group's (a sliding group's own pool)
        q = self._rope_store(positions, qkv, self.num_heads, self.num_kv_heads, self.head_dim,
                             self.rotary.cos_sin_cache, self.rotary.is_neox,
                             qn.weight if qn is not None else None, kn.weight if kn is not None else None,
                             qn.eps if qn is not None else 0.0, k_cache, v_cache, slots,
                             **self.attn.kv_scales)
        return self.o_proj(self.attn.attend(q, meta))

    def _unfused(self, positions: torch.Tensor, qkv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        t = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        return self.attn(q.reshape(t, -1), k.reshape(t, -1), v, meta)  # v: a strided view, stored as is


class LlamaMLP(nn.Module):
    def __init__(self, cfg: PretrainedConfig, backend: str) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported by the Llama family (only silu)")
        bias = bool(getattr(cfg, "mlp_bias", False))
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], bias=bias)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=bias)
        self.act = SiluAndMul(backend)

    def forward(self, x: torch.Tensor | QuantizedAct) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))

    def sole_readers(self) -> list[tuple[nn.Module, nn.Module]]:
        """(producer, the one module that reads its output) in this forward (layers/fp8_scaled.py
        quantize_producers)."""
        return [(self.act, self.down_proj)]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: PretrainedConfig, qkv_bias: bool, qk_norm: bool, backend: str) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, qkv_bias, qk_norm, backend)
        self.mlp = LlamaMLP(cfg, backend)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    def sole_readers(self) -> list[tuple[nn.Module, nn.Module]]:
        """(producer, the one module that reads its output) in this forward: the input norm's output goes to a
        Llama attention's qkv projection alone, the post-attention norm's to a dense MLP's gate_up alone (an MoE
        block's router reads it too)."""
        pairs: list[tuple[nn.Module, nn.Module]] = []
        if isinstance(self.self_attn, LlamaAttention):
            pairs.append((self.input_layernorm, self.self_attn.qkv_proj))
        if isinstance(self.mlp, LlamaMLP):
            pairs.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
        return pairs


class LlamaModel(nn.Module):
    chain: DecodeChain | None = None  # use_decode_chain builds one once the GEMVs are bound
    aux: Any = None  # EAGLE-3: an AuxCapture (models/eagle.py) given layers' outputs are copied into

    def __init__(self, cfg: PretrainedConfig, qkv_bias: bool, qk_norm: bool, backend: str) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, qkv_bias, qk_norm, backend)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, backend)

    def use_decode_chain(self, backend: str) -> bool:
        """Run batches of up to 16 rows through `backend`'s fused decode chain where every layer is served
        (layers/decode_chain.py); call after binding the GEMV kernel. Returns whether the chain is on."""
        self.chain = DecodeChain.build(self, backend)
        return self.chain is not None

    def calibrating(self) -> bool:
        """Whether online fp8 KV calibration still observes a layer's stores (executor/kv_calibration.py): the
        chain stores K/V itself, unobserved, so rows it would serve (short prefill chunks too) take the layers."""
        return any(layer.self_attn.attn.calibration is not None for layer in self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.chain is not None and self.aux is None and self.chain.serves(x) and not self.calibrating():
            return self.chain.forward(x, positions, meta)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(positions, x, residual, meta)
            if self.aux is not None:
                self.aux.write(i, x, residual)
        out, _ = self.norm(x, residual)
        return out


class LlamaForCausalLM(nn.Module):
    qkv_bias = False  # class-level switches; subclasses for the other families flip them
    qk_norm = False
    supports_cuda_graphs = True  # the forward never syncs with the host (executor/cuda_graph.py)
    piecewise_graphs = True  # dense: everything but attention may be captured for eager steps (executor/piecewise.py)

    def __init__(self, hf_config: PretrainedConfig, backend: str = "torch") -> None:
        super().__init__()
        self.config = hf_config
        qkv_bias = self.qkv_bias or bool(getattr(hf_config, "attention_bias", False))
        self.model = LlamaModel(hf_config, qkv_bias, self.qk_norm, backend)
        self.lm_head = ParallelLMHead.of_model(hf_config, self.model.embed_tokens)
        self.tie_word_embeddings = self.lm_head.tied

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into this rank's shards; returns the names of parameters that were filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name.startswith("lm_head.") and self.tie_word_embeddings:
                continue  # the embedding is the head
            for ckpt, fused, shard in _STACKED:
                if f".{ckpt}." in name:
                    target = name.replace(f".{ckpt}.", f".{fused}.")
                    self._param(params, target, name).weight_loader(params[target], tensor, shard)
                    loaded.add(target)
                    break
            else:
                param = self._param(params, name, name)
                getattr(param, "weight_loader", _default_loader)(param, tensor)
                loaded.add(name)
        return loaded

    @staticmethod
    def _param(params: dict[str, nn.Parameter], target: str, source: str) -> nn.Parameter:
        if target not in params:
            raise KeyError(f"checkpoint tensor {source!r} has no matching parameter in the model")
        return params[target]


def _default_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
    param.data.copy_(loaded)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


MODELS: dict[str, type[nn.Module]] = {"LlamaForCausalLM": LlamaForCausalLM, "MistralForCausalLM": MistralForCausalLM,
                                      "Qwen2ForCausalLM": Qwen2ForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM}
