"""gpt-oss (GptOssForCausalLM): the Llama decoder with attention sinks, banded layers and its own MoE.

- Attention: q/k/v/o biases, learned per-head sink logits in the softmax (`self_attn.sinks`), layers listed as
  `sliding_attention` in `layer_types` see the last `sliding_window` tokens (alternating with full layers),
  YaRN rotary (neox halves) with its attention factor.
- MoE: a biased linear router, top-k of the logits then softmax over the chosen k; experts with biases and a
  clamped SwiGLU, gate = min(g, limit), up = clamp(u, -limit, limit), out = (up + 1) * gate * sigmoid(alpha gate),
  where the checkpoint interleaves gate and up columns (even / odd). They run through the `fused_moe` op of
  backends.moe (its bias and swiglu_limit arguments), so with the Triton one decode is CUDA-graph capturable.
- Expert weights ship in MXFP4 (kernels/mxfp4.py), `<proj>_blocks` + `<proj>_scales`, and are dequantized to the
  model's dtype at load, or, with precision.moe_weight_format = mxfp4, kept as they are for the fused_moe_mxfp4
  op (kernels/moe/triton_mxfp4.py); transformers' own save writes them in float ([E, H, 2I] / [E, I, H]). Both
  load (float ones are rounded to MXFP4 when the experts are kept in it).
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

import appliance.kernels.moe  # noqa: F401  (registers the fused_moe kernels)
from appliance.kernels import mxfp4
from appliance.layers.attention import Attention
from appliance.layers.embedding import ParallelLMHead
from appliance.layers.kernels import kernel
from appliance.layers.parallel_state import (
    divide,
    get_ep_size,
    get_tp_rank,
    get_tp_size,
    tp_all_reduce,
)
from appliance.models.layer_types import SLIDING, layer_types
from appliance.models.llama import LlamaAttention, LlamaForCausalLM
from appliance.models.mixtral import MoEDecoderLayer, MoEModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)"
                            r"(?P<kind>_blocks|_scales|_bias|)$")


class GptOssExperts(nn.Module):
    """All experts of a layer: w13 [E, 2I, H] (gate rows, then up rows), w2 [E, H, I], their biases; or, with
    moe_weight_format "mxfp4", the same matrices as MXFP4 blocks [E, N, K/2] and scales [E, N, K/32] (kernels/mxfp4.py)
    for the fused_moe_mxfp4 op. Tensor parallelism splits I; the down bias is added on rank 0 only (the ranks'
    partial sums are all-reduced). In MXFP4 each rank holds whole 32-value scale groups of down's input: I is
    padded to a multiple of 32 x tp with zero units (zero gate / up rows and biases give an activation of 0, and
    zero down columns), so any tp splits it exactly (gpt-oss's 2880 at tp 4: 736 a rank, the last 64 padding)."""

    def __init__(self, cfg: PretrainedConfig, moe_backend: str, moe_weight_format: str = "dequantized") -> None:
        super().__init__()
        if get_ep_size() > 1:
            raise ValueError("gpt-oss experts do not support expert parallelism yet (tensor parallelism does)")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        e, h = cfg.num_local_experts, cfg.hidden_size
        self.num_experts, self.hidden_size = e, h
        self.full_intermediate = cfg.intermediate_size
        self.mxfp4 = moe_weight_format == "mxfp4"
        group_tp = mxfp4.BLOCK * self.tp_size
        self.intermediate = (-(-cfg.intermediate_size // group_tp) * mxfp4.BLOCK if self.mxfp4
                             else divide(cfg.intermediate_size, self.tp_size))
        self.limit = float(cfg.swiglu_limit)
        self.alpha = float(getattr(cfg, "swiglu_alpha", 1.702))
        i = self.intermediate
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        if self.mxfp4:
            self._mxfp4_parameters(e, h, i)
            self._op = kernel("fused_moe_mxfp4", moe_backend)
        else:
            self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
            self.w2_weight = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
            self._op = kernel("fused_moe", moe_backend)

    def _mxfp4_parameters(self, e: int, h: int, i: int) -> None:
        if h % mxfp4.BLOCK or self.full_intermediate % mxfp4.BLOCK:
            raise ValueError(f"MXFP4 experts need hidden ({h}) and intermediate ({self.full_intermediate}) sizes "
                             f"that are multiples of {mxfp4.BLOCK}; use precision.moe_weight_format = dequantized")
        for name, n, k in (("w13", 2 * i, h), ("w2", h, i)):
            blocks = torch.empty(e, n, k // 2, dtype=torch.uint8)
            scales = torch.empty(e, n, k // mxfp4.BLOCK, dtype=torch.uint8)
            self.register_parameter(f"{name}_blocks", nn.Parameter(blocks, requires_grad=False))
            self.register_parameter(f"{name}_scales", nn.Parameter(scales, requires_grad=False))
        if self.w13_blocks.device.type == "cpu":  # a Triton kernel: a GPU, or the interpreter (tests); meta: estimates
            from appliance.kernels.triton.common import INTERPRET

            if not INTERPRET:
                raise ValueError("precision.moe_weight_format = 'mxfp4' runs a Triton kernel, which needs a GPU; "
                                 "use dequantized on the CPU")

    def _shard(self, proj: str, tensor: torch.Tensor, k_per_column: int = 1) -> torch.Tensor:
        """This rank's part of an expert tensor in the checkpoint's orientation (outputs on dim 1): gate_up's
        interleaved gate / up rows regrouped as this rank's gate rows, then its up rows; down's input columns
        (dim 2, each column holding k_per_column values: 32 for a scale group or a block row of 16 bytes). Units
        past the real intermediate (MXFP4's padding) are zeros."""
        i, r = self.intermediate, self.tp_rank
        lo, hi = r * i, min((r + 1) * i, self.full_intermediate)
        if proj == "gate_up_proj":
            gate, up = tensor[:, 0::2], tensor[:, 1::2]  # interleaved gate / up outputs
            return torch.cat((_zero_padded(gate[:, lo:hi], 1, i), _zero_padded(up[:, lo:hi], 1, i)), dim=1)
        if tensor.dim() == 2:  # the down bias: whole on every rank
            return tensor
        return _zero_padded(tensor[:, :, lo // k_per_column:hi // k_per_column], 2, i // k_per_column)

    def _fill(self, param: nn.Parameter, proj: str, kind: str, shard: torch.Tensor, full: torch.Tensor) -> str:
        if shard.shape != param.shape:
            raise ValueError(f"experts.{proj}{kind} of shape {tuple(full.shape)} does not fit "
                             f"{self.num_experts} experts x hidden {self.hidden_size} x intermediate "
                             f"{self.full_intermediate}")
        param.data.copy_(shard)
        return next(n for n, p in self.named_parameters() if p is param)

    def load(self, proj: str, kind: str, tensor: torch.Tensor) -> list[str]:
        """One expert tensor in the checkpoint's orientation (output rows, input columns: gate_up [E, 2I, H]
        interleaved, down [E, H, I]; biases [E, 2I] / [E, H]); kind "" a float matrix, "_bias" a bias. Returns
        the parameters it filled (a float matrix is rounded to MXFP4 when the experts are kept in it)."""
        prefix = "w13" if proj == "gate_up_proj" else "w2"
        if kind == "_bias":
            return [self._fill(getattr(self, f"{prefix}_bias"), proj, kind, self._shard(proj, tensor), tensor)]
        if self.mxfp4:
            return self.load_mxfp4(proj, *mxfp4.quantize(tensor))
        return [self._fill(getattr(self, f"{prefix}_weight"), proj, kind, self._shard(proj, tensor), tensor)]

    def load_mxfp4(self, proj: str, blocks: torch.Tensor, scales: torch.Tensor) -> list[str]:
        """A checkpoint's MXFP4 pair (blocks [E, N, K/32, 16], scales [E, N, K/32]): kept as it is, or
        dequantized to the model dtype."""
        prefix = "w13" if proj == "gate_up_proj" else "w2"
        if not self.mxfp4:
            return self.load(proj, "", mxfp4.dequantize(blocks, scales, self.w13_bias.dtype))
        return [self._fill(getattr(self, f"{prefix}_blocks"), proj, "_blocks",
                           mxfp4.packed(self._shard(proj, blocks, mxfp4.BLOCK)), blocks),
                self._fill(getattr(self, f"{prefix}_scales"), proj, "_scales",
                           self._shard(proj, scales, mxfp4.BLOCK), scales)]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        extra = {"w13_bias": self.w13_bias, "w2_bias": self.w2_bias if self.tp_rank == 0 else None,
                 "swiglu_limit": self.limit, "swiglu_alpha": self.alpha}
        if self.mxfp4:
            return self._op(x, self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales, weights, ids,
                            **extra)
        return self._op(x, self.w13_weight, self.w2_weight, weights, ids, **extra)


def _zero_padded(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """t with zeros appended along dim up to size."""
    missing = size - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat((t, t.new_zeros(shape)), dim=dim)


class GptOssMoE(nn.Module):
    def __init__(self, cfg: PretrainedConfig, moe_backend: str, moe_weight_format: str = "dequantized") -> None:
        super().__init__()
        self.top_k = int(cfg.num_experts_per_tok)
        self.router = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=True)
        self.router.requires_grad_(False)
        self.experts = GptOssExperts(cfg, moe_backend, moe_weight_format)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router(x)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        weights = torch.softmax(top, dim=1, dtype=top.dtype)
        return tp_all_reduce(self.experts(x, weights, ids))


class GptOssForCausalLM(LlamaForCausalLM):
    is_moe = True  # the model runner passes moe_backend (backends.moe) for the experts' fused_moe op
    mxfp4_experts = True  # and moe_weight_format (precision.moe_weight_format): MXFP4 kept or dequantized
    piecewise_graphs = False
    sliding_window_attention = True  # windows are applied, so max_model_len is not capped at sliding_window

    def __init__(self, hf_config: PretrainedConfig, backend: str = "torch", moe_backend: str | None = None,
                 moe_weight_format: str = "dequantized") -> None:
        nn.Module.__init__(self)
        self.moe_backend = moe_backend or backend
        qc = getattr(hf_config, "quantization_config", None)
        method = (qc if isinstance(qc, dict) else qc.to_dict()).get("quant_method") if qc else None
        if method not in (None, "mxfp4"):
            raise ValueError(f"gpt-oss checkpoint quantization {method!r} is not supported (mxfp4 or none)")
        self.config = hf_config
        window = int(hf_config.sliding_window)
        layers = [MoEDecoderLayer(hf_config, LlamaAttention(hf_config, True, False, backend, sinks=True,
                                                            sliding_window=window if kind == SLIDING else None),
                                  GptOssMoE(hf_config, self.moe_backend, moe_weight_format), backend)
                  for kind in layer_types(hf_config)]
        self.model = MoEModel(hf_config, layers, backend)
        self.lm_head = ParallelLMHead.of_model(hf_config, self.model.embed_tokens)
        self.tie_word_embeddings = self.lm_head.tied

    @property
    def supports_cuda_graphs(self) -> bool:  # type: ignore[override]
        """With the Triton fused MoE (its expert sort never syncs with the host); the torch one loops on the host."""
        return self.moe_backend == "triton"

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()
        loaded |= super().load_weights(self._experts_and_sinks(weights, loaded))
        return loaded

    def _experts_and_sinks(self, weights: Iterable[tuple[str, torch.Tensor]],
                           loaded: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Expert tensors go to GptOssExperts (MXFP4 pairs once both halves arrived); sinks move under the
        attention layer; the rest follows the Llama loader."""
        pending: dict[str, torch.Tensor] = {}  # a blocks / scales half waiting for its partner
        for name, tensor in weights:
            m = _EXPERT_TENSOR.match(name)
            if m is None:
                yield name.replace(".self_attn.sinks", ".self_attn.attn.sinks"), tensor
                continue
            prefix, proj, kind = m["prefix"], m["proj"], m["kind"]
            experts = self.get_submodule(prefix)
            if not isinstance(experts, GptOssExperts):
                raise KeyError(f"checkpoint tensor {name!r} names experts, but {prefix} is not an expert layer")
            if kind in ("_blocks", "_scales"):
                other = f"{prefix}.{proj}{'_scales' if kind == '_blocks' else '_blocks'}"
                if other not in pending:
                    pending[name] = tensor
                    continue
                blocks, scales = (tensor, pending.pop(other)) if kind == "_blocks" else (pending.pop(other), tensor)
                filled = experts.load_mxfp4(proj, blocks, scales)
            else:  # transformers' float layout is transposed: [E, H, 2I] / [E, I, H]
                filled = experts.load(proj, kind, tensor if kind == "_bias" else tensor.transpose(1, 2))
            loaded.update(f"{prefix}.{n}" for n in filled)
        if pending:
            raise ValueError(f"mxfp4 expert tensors without their blocks/scales partner: {sorted(pending)[:4]}")


MODELS: dict[str, type[nn.Module]] = {"GptOssForCausalLM": GptOssForCausalLM}
