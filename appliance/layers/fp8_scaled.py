"""FP8 weights with per-tensor or per-channel scales and fp8 activations: the FP8 checkpoints people ship.

- compressed-tensors (llm-compressor; config.json `quantization_config.quant_method = "compressed-tensors"`, a
  config group of 8-bit float weights, strategy `tensor` or `channel`, and 8-bit float input activations,
  `dynamic` per token or static per tensor): `<proj>.weight` e4m3, `<proj>.weight_scale` [1] or [N, 1],
  `<proj>.input_scale` [1] when static.
- ModelOpt (`quant_algo: FP8`, in config.json's quantization_config or hf_quant_config.json): per-tensor
  `weight_scale` and static `input_scale`.
- `precision.quantization = "w8a8_fp8"` on a 16-bit checkpoint: per-channel weights quantized after loading and
  dynamic per-token activations (as SGLang's w8a8_fp8 does).

Inside, every layer holds `weight` e4m3 [N, K], `weight_scale` float32 [N] (one per output row: a fused qkv or
gate_up layer whose parts have their own per-tensor scales keeps them row by row) and `input_scale` [1] or None.
The GEMM is kernels/fp8_gemm.py. Where a layer's input is read by it alone, comes from an RMSNorm or
SiLU-and-mul and is quantized with dynamic scales, the producer writes it quantized (`quantize_producers`),
which saves the quantization's launch. MoE experts in these formats (gate / up / down of each expert, per-tensor
or per-channel) become e4m3 stacks with one scale per output row, run weight-only by the fused MoE kernels (the
tile dequantized in the GEMM; activations stay 16-bit, so a checkpoint's static expert input scales go unused).
KV cache scales in the same checkpoints go to the attention layers
(executor/kv_scales.py).
"""
from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from appliance.kernels.fp8_gemm import FP8, FP8_MAX, QuantizedAct, scaled_linear
from appliance.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from appliance.layers.parallel_state import tp_all_gather, tp_all_reduce

if TYPE_CHECKING:
    from transformers import PretrainedConfig

SCALED_METHODS = ("compressed-tensors", "modelopt", "w8a8_fp8")


@dataclass(frozen=True)
class Fp8ScaledConfig:
    method: str  # compressed-tensors / modelopt / w8a8_fp8 (online)
    static_input: bool  # a checkpoint input_scale per layer; else dynamic per-token scales
    ignored: tuple[str, ...] = ()  # module names, `re:` patterns (compressed-tensors) or wildcards (ModelOpt)
    online: bool = False  # quantize a 16-bit checkpoint's weights after loading

    def applies_to(self, name: str) -> bool:
        for pat in self.ignored:
            if pat.startswith("re:"):
                if re.match(pat[3:], name):
                    return False
            elif fnmatch.fnmatch(name, pat) or name == pat or name.endswith("." + pat):
                return False
        return True


def _compressed_tensors(qc: dict[str, Any]) -> Fp8ScaledConfig:
    groups = list((qc.get("config_groups") or {}).values())
    if not groups:
        raise ValueError("compressed-tensors checkpoint without config_groups")
    for g in groups:
        w, a = g.get("weights") or {}, g.get("input_activations")
        if w.get("type") != "float" or w.get("num_bits") != 8 or w.get("strategy") not in ("tensor", "channel"):
            raise ValueError(f"compressed-tensors weights {w} are not supported (8-bit float, strategy tensor or "
                             "channel)")
        if w.get("dynamic"):
            raise ValueError("compressed-tensors dynamic weight scales are not supported")
        if not a or a.get("type") != "float" or a.get("num_bits") != 8:
            raise ValueError(f"compressed-tensors input activations {a} are not supported (8-bit float)")
        if not (a.get("dynamic") and a.get("strategy") == "token") and not (not a.get("dynamic")
                                                                             and a.get("strategy") == "tensor"):
            raise ValueError(f"compressed-tensors input activations {a} are not supported (dynamic per token, "
                             "or static per tensor)")
    statics = {not g["input_activations"].get("dynamic") for g in groups}
    if len(statics) != 1:
        raise ValueError("compressed-tensors groups mixing static and dynamic activations are not supported")
    return Fp8ScaledConfig("compressed-tensors", statics.pop(), tuple(qc.get("ignore") or ()))


def _modelopt(qc: dict[str, Any]) -> Fp8ScaledConfig:
    algo = qc.get("quant_algo")
    if algo != "FP8":
        raise ValueError(f"ModelOpt quant_algo {algo!r} is not supported (FP8)")
    return Fp8ScaledConfig("modelopt", True, tuple(qc.get("exclude_modules") or qc.get("ignore") or ()))


def checkpoint_quant(hf_config: PretrainedConfig, model_dir: Path | None) -> dict[str, Any] | None:
    """The checkpoint's quantization description: config.json's quantization_config, or ModelOpt's
    hf_quant_config.json `quantization` section (as a quant_method modelopt dict)."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc:
        return qc if isinstance(qc, dict) else qc.to_dict()
    path = model_dir / "hf_quant_config.json" if model_dir is not None else None
    if path is not None and path.is_file():
        return {"quant_method": "modelopt", **json.loads(path.read_text()).get("quantization", {})}
    return None


def scaled_config(quantization: str | None, hf_config: PretrainedConfig,
                  model_dir: Path | None) -> Fp8ScaledConfig | None:
    """The scaled-fp8 scheme to run, or None when this module has no part in it (16-bit, or block fp8). A
    requested scheme the checkpoint does not ship is an error."""
    qc = checkpoint_quant(hf_config, model_dir)
    method = qc.get("quant_method") if qc else None
    if method in ("compressed-tensors", "modelopt"):
        if quantization not in (None, method, "w8a8_fp8"):
            raise ValueError(f"precision.quantization={quantization!r} but the checkpoint is {method}")
        return _compressed_tensors(qc) if method == "compressed-tensors" else _modelopt(qc)  # type: ignore[arg-type]
    if quantization in ("compressed-tensors", "modelopt"):
        raise ValueError(f"precision.quantization={quantization!r} but the checkpoint has no {quantization} "
                         "quantization_config")
    if quantization == "w8a8_fp8":
        if method is not None:
            raise ValueError(f"precision.quantization='w8a8_fp8' on a {method} checkpoint is not supported")
        return Fp8ScaledConfig("w8a8_fp8", False, ("lm_head",), online=True)
    return None


# ---- the layers ------------------------------------------------------------------------------------------------

def _forward_column(self: nn.Module, x: torch.Tensor | QuantizedAct) -> torch.Tensor:
    y = scaled_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)
    return tp_all_gather(y, dim=-1) if getattr(self, "gather_output", False) else y


def _forward_row(self: nn.Module, x: torch.Tensor | QuantizedAct) -> torch.Tensor:
    y = scaled_linear(x, self.weight, self.weight_scale, self.input_scale)
    if self.reduce_results:
        y = tp_all_reduce(y)
    return y + self.bias if self.bias is not None else y  # the bias once, after the sum


class ScaledFp8ColumnParallelLinear(ColumnParallelLinear):
    forward = _forward_column


class ScaledFp8MergedColumnParallelLinear(MergedColumnParallelLinear):
    forward = _forward_column


class ScaledFp8QKVParallelLinear(QKVParallelLinear):
    forward = _forward_column


class ScaledFp8RowParallelLinear(RowParallelLinear):
    forward = _forward_row


_TWINS: dict[type[nn.Module], type[nn.Module]] = {
    ColumnParallelLinear: ScaledFp8ColumnParallelLinear, MergedColumnParallelLinear: ScaledFp8MergedColumnParallelLinear,
    QKVParallelLinear: ScaledFp8QKVParallelLinear, RowParallelLinear: ScaledFp8RowParallelLinear,
}
_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _checkpoint_names(name: str) -> list[str]:
    """The checkpoint's module names behind one of ours (a fused layer has one per part)."""
    head, _, last = name.rpartition(".")
    return [f"{head}.{p}" if head else p for p in _PARTS.get(last, (last,))]


def _full_rows(module: nn.Module, shard_id: Any) -> int:
    """Output rows of the whole model's checkpoint tensor a scale belongs to (a per-tensor scale is expanded)."""
    if isinstance(module, QKVParallelLinear):
        q, kv = module.total_num_heads * module.head_dim, module.total_num_kv_heads * module.head_dim
        return {"q": q, "k": kv, "v": kv, None: q + 2 * kv}[shard_id]
    if isinstance(module, MergedColumnParallelLinear) and shard_id is not None:
        return module.output_sizes[shard_id]
    return module.output_size


def _scale_loader(module: nn.Module) -> Any:
    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
        t = loaded.float().reshape(-1)
        if t.numel() == 1:
            t = t.expand(_full_rows(module, shard_id)).contiguous()
        if isinstance(module, RowParallelLinear):  # a scale per output row: not split over ranks
            if t.shape != param.shape:
                raise ValueError(f"weight_scale of {t.numel()} rows does not fit {tuple(param.shape)}")
            param.data.copy_(t)
        elif shard_id is None and not isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
            module.weight_loader(param, t)
        else:
            module.weight_loader(param, t, shard_id)
    return load


def _input_scale_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """A fused layer's parts read the same input: one static scale, the largest of theirs."""
    param.data.copy_(torch.maximum(param.data, loaded.float().reshape(-1).max().reshape(1)))


def _params(module: nn.Module, static_input: bool, device: torch.device) -> None:
    rows, cols = module.weight.shape
    loader = module.weight.weight_loader
    module.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8, device=device), requires_grad=False)
    module.weight.weight_loader = loader  # type: ignore[attr-defined]
    module.weight_scale = nn.Parameter(torch.zeros(rows, device=device), requires_grad=False)
    module.weight_scale.weight_loader = _scale_loader(module)  # type: ignore[attr-defined]
    if static_input:
        module.input_scale = nn.Parameter(torch.zeros(1, device=device), requires_grad=False)
        module.input_scale.weight_loader = _input_scale_loader  # type: ignore[attr-defined]
    else:
        module.input_scale = None


def quantize_producers(model: nn.Module) -> int:
    """Every norm or gated activation whose output only an FP8 linear with dynamic per-token scales reads
    writes that output quantized in its own kernel (ops rms_norm_quant, silu_and_mul_quant: a QuantizedAct the
    linear uses as it is), instead of a 16-bit tensor the linear quantizes in a launch of its own. The model's
    modules name the pairs (`sole_readers`); a consumer with a static input scale keeps the 16-bit input.
    Returns the producers changed."""
    changed = 0
    for module in model.modules():
        pairs = module.sole_readers() if hasattr(module, "sole_readers") else []
        for producer, consumer in pairs:
            if (type(consumer) in _TWINS.values() and consumer.input_scale is None
                    and hasattr(producer, "quantize_output")):
                producer.quantize_output()
                changed += 1
    return changed


def _expert_targets(model: nn.Module, cfg: Fp8ScaledConfig) -> list[nn.Module]:
    """The 16-bit FusedMoE layers the scheme covers (block-fp8 ones are another format)."""
    from appliance.layers.moe import FusedMoE  # moe.py imports the fp8 layers

    out = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and module.quant is None and cfg.applies_to(name):
            out.append(module)
    return out


def _expert_params(moe: nn.Module, w13: torch.Tensor | None = None, w2: torch.Tensor | None = None) -> None:
    """e4m3 expert stacks and their per-row scales ([E, 2I], [E, H]); given tensors fill them, else empty ones
    for the checkpoint. The fused MoE kernels dequantize each weight tile in the GEMM (weight-only)."""
    device = moe.w13_weight.device
    for name in ("w13", "w2"):
        shape = getattr(moe, f"{name}_weight").shape
        given = w13 if name == "w13" else w2
        q, scale = given if given is not None else (torch.empty(shape, dtype=FP8, device=device),
                                                    torch.zeros(shape[:2], device=device))
        setattr(moe, f"{name}_weight", nn.Parameter(q, requires_grad=False))
        setattr(moe, f"{name}_weight_scale", nn.Parameter(scale, requires_grad=False))


def _targets(model: nn.Module, cfg: Fp8ScaledConfig) -> list[tuple[str, nn.Module]]:
    out = []
    for name, module in model.named_modules():
        if type(module) not in _TWINS:
            continue
        keep = [cfg.applies_to(n) for n in _checkpoint_names(name)]
        if all(keep):
            out.append((name, module))
        elif any(keep):
            raise ValueError(f"{cfg.method} fp8: the parts of fused layer {name} are quantized differently")
    return out


def prepare_scaled_fp8(model: nn.Module, cfg: Fp8ScaledConfig) -> int:
    """Before loading a checkpoint in `cfg`'s format: every covered linear layer gets e4m3 weights and its scales
    (parameters the checkpoint fills); returns the layers changed. Works on meta tensors (the memory estimate)."""
    targets = _targets(model, cfg)
    for _, module in targets:
        _params(module, cfg.static_input, module.weight.device)
        module.__class__ = _TWINS[type(module)]
    experts = _expert_targets(model, cfg)
    for moe in experts:
        _expert_params(moe)
    quantize_producers(model)
    return len(targets) + len(experts)


def quantize_scaled_fp8(model: nn.Module, cfg: Fp8ScaledConfig) -> int:
    """After loading a 16-bit checkpoint (w8a8_fp8): per-channel e4m3 weights, dynamic per-token activations."""
    targets = _targets(model, cfg)
    for _, module in targets:
        w = module.weight.data.float()
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp_min(1e-12)
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        _params(module, False, w.device)
        module.weight.data, module.weight_scale.data = q, scale
        module.__class__ = _TWINS[type(module)]
    experts = _expert_targets(model, cfg)
    for moe in experts:
        _expert_params(moe, _row_quantize_experts(moe.w13_weight.data), _row_quantize_experts(moe.w2_weight.data))
    quantize_producers(model)
    return len(targets) + len(experts)


def _row_quantize_experts(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An expert stack [E, N, K] quantized per row, one expert at a time (a float32 copy of the whole stack
    would not fit beside a large model)."""
    # here, not at the top: importing kernels.moe defines every MoE Triton kernel, which a dense model's
    # start-up (model_loader.prepare_quantization imports this module) does not need
    from appliance.kernels.moe.reference import row_quantize

    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    scale = torch.empty(w.shape[:2], device=w.device)
    for e in range(w.shape[0]):
        q[e], scale[e] = row_quantize(w[e])
    return q, scale
