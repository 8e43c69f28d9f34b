"""Where an fp8 KV cache's scales come from: the checkpoint, `precision.quantization_param_path`, or 1.0.

A scale s means the cache stores x / s and attention reads fp8 * s (kernels/reference/kv_quant.py). Checkpoints
name them per attention layer, in the layouts the quantizers write:

- ModelOpt (hf_quant_config.json `kv_cache_quant_algo: FP8`): `...self_attn.k_proj.k_scale`, `...v_proj.v_scale`
- compressed-tensors (`kv_cache_scheme`) and vLLM's own exports: `...self_attn.k_scale`, `...self_attn.v_scale`
  (or under `...self_attn.attn.`); older compressed-tensors / Quark: `...k_proj.output_scale`, `...v_proj.output_scale`
- one scale for both: `...self_attn.kv_scale`

A scale is one number (per tensor) or one per kv head of the whole model (per head; this rank takes its heads).
The JSON file is vLLM's `quantization_param_path` format: {"kv_cache": {"dtype": "float8_e4m3fn",
"scaling_factor": {"<tp rank>": {"<layer>": scale}}}}, one scale for K and V of a layer.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig

log = logging.getLogger(__name__)

_SUFFIXES = (  # checkpoint name suffix -> which cache it scales
    (".attn.k_scale", "k"), (".attn.v_scale", "v"),
    (".k_proj.k_scale", "k"), (".v_proj.v_scale", "v"),
    (".k_proj.output_scale", "k"), (".v_proj.output_scale", "v"),
    (".k_scale", "k"), (".v_scale", "v"), (".kv_scale", "kv"),
)


def kv_scale_name(name: str) -> tuple[str, str] | None:
    """(the attention module's checkpoint prefix, "k" | "v" | "kv") when `name` is a KV cache scale, else None."""
    for suffix, which in _SUFFIXES:
        if name.endswith(suffix):
            prefix = name[: -len(suffix)]
            return (prefix, which) if prefix.endswith(".self_attn") else None
    return None


@dataclass
class CheckpointKVScales:
    """Collects the KV scales out of a checkpoint's tensor stream (they are no model parameters)."""
    scales: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)  # (prefix, "k" | "v") -> values

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            hit = kv_scale_name(name)
            if hit is None:
                yield name, tensor
                continue
            prefix, which = hit
            for part in ("k", "v") if which == "kv" else (which,):
                self.scales[(prefix, part)] = tensor.detach().float().reshape(-1).cpu()


def _per_head(values: torch.Tensor, layer: nn.Module, tp_rank: int, tp_size: int, what: str) -> torch.Tensor:
    """One scale per kv head of this rank out of a per-tensor or whole-model per-head scale."""
    heads = layer.num_kv_heads
    if values.numel() == 1:
        out = values.expand(heads).clone()
    elif values.numel() == heads * tp_size:
        out = values[tp_rank * heads : (tp_rank + 1) * heads].clone()
    else:
        raise ValueError(f"{what}: {values.numel()} scales fit neither one tensor nor {heads} kv heads per rank "
                         f"over {tp_size} ranks")
    if not torch.isfinite(out).all() or (out <= 0).any():
        raise ValueError(f"{what}: KV cache scales must be finite and positive, got {out.tolist()}")
    return out.float()


def read_param_file(path: str, tp_rank: int, tp_size: int, num_layers: int) -> list[float]:
    """This rank's per-layer scales from a quantization_param_path JSON (vLLM's format), checked."""
    try:
        doc = json.loads(Path(path).read_text())
        factors = doc["kv_cache"]["scaling_factor"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"precision.quantization_param_path {path!r}: not a KV scale file "
                         f"({{\"kv_cache\": {{\"scaling_factor\": {{rank: {{layer: scale}}}}}}}}): {exc}") from exc
    if len(factors) != tp_size or str(tp_rank) not in {str(k) for k in factors}:
        raise ValueError(f"precision.quantization_param_path {path!r} has scales for {len(factors)} tensor-parallel "
                         f"ranks; this deployment has {tp_size}")
    mine = {int(k): float(v) for k, v in {str(r): f for r, f in factors.items()}[str(tp_rank)].items()}
    if sorted(mine) != list(range(num_layers)):
        raise ValueError(f"precision.quantization_param_path {path!r} names layers {sorted(mine)[:8]}...; the model "
                         f"has {num_layers} attention layers (0..{num_layers - 1})")
    return [mine[i] for i in range(num_layers)]


def install(model: nn.Module, layers: list[nn.Module], checkpoint: CheckpointKVScales, param_path: str | None,
            tp_rank: int, tp_size: int, kv_dtype_name: str) -> str:
    """Give every attention layer of an fp8 cache its k/v scales; returns where they came from. The file wins
    over the checkpoint; with neither, scales of 1.0 and a WARNING naming the risk."""
    if param_path is not None:
        per_layer = read_param_file(param_path, tp_rank, tp_size, len(layers))
        for layer, s in zip(layers, per_layer):
            t = _per_head(torch.tensor([s]), layer, tp_rank, tp_size, param_path)
            layer.set_kv_scales(t, t.clone())
        return f"quantization_param_path {param_path}"
    names = {id(m): n for n, m in model.named_modules()}
    found = 0
    for layer in layers:
        prefix = names.get(id(layer), "").removesuffix(".attn")
        k, v = checkpoint.scales.get((prefix, "k")), checkpoint.scales.get((prefix, "v"))
        if k is None and v is None:
            continue
        if k is None or v is None:
            raise ValueError(f"the checkpoint has a {'k' if k is not None else 'v'} scale for {prefix} but no "
                             f"{'v' if k is not None else 'k'} scale")
        layer.set_kv_scales(_per_head(k, layer, tp_rank, tp_size, f"{prefix} k_scale"),
                            _per_head(v, layer, tp_rank, tp_size, f"{prefix} v_scale"))
        found += 1
    if found == len(layers):
        return "the checkpoint"
    if found:
        raise ValueError(f"the checkpoint has KV cache scales for {found} of {len(layers)} attention layers")
    for layer in layers:
        layer.set_kv_scales(torch.ones(layer.num_kv_heads), torch.ones(layer.num_kv_heads))
    log.warning("precision.kv_cache_dtype=%s: the checkpoint has no k/v scales and no "
                "precision.quantization_param_path is set, so every KV cache scale is 1.0: keys and values whose "
                "magnitude exceeds the format's largest value (448 for e4m3, 57344 for e5m2) saturate there and "
                "accuracy may suffer. Use a checkpoint with KV scales (ModelOpt, compressed-tensors) or a scale file.",
                kv_dtype_name)
    return "default 1.0"


def calibration_placeholders(layers: list[nn.Module], checkpoint: CheckpointKVScales, tokens: int) -> str:
    """Online calibration (executor/kv_calibration.py) sets the scales from served tokens: hold 1.0 until then
    (an MLA latent cache has one kv head: one scale), and say when the checkpoint's scales are set aside."""
    for layer in layers:
        layer.set_kv_scales(torch.ones(layer.num_kv_heads), torch.ones(layer.num_kv_heads))
    if checkpoint.scales:
        log.info("precision.kv_cache_calibration_tokens is set: the checkpoint's KV cache scales are replaced by "
                 "online calibration")
    return f"online calibration over the first {tokens} prefill tokens"


def setup(config: ApplianceConfig, model: nn.Module, layers: list[nn.Module], checkpoint: CheckpointKVScales) -> str:
    """The runner's entry for an fp8 KV cache: refuse what this build cannot quantize, install the scales, log
    where they came from (returned too)."""
    from appliance.layers.parallel_state import get_tp_rank, get_tp_size

    precision = config.precision
    if not all(hasattr(layer, "set_kv_scales") for layer in layers):
        raise ValueError(f"precision.kv_cache_dtype={precision.kv_cache_dtype}: this model's attention layers "
                         "have no fp8 KV cache in this build; use auto")
    if precision.kv_cache_calibration_tokens > 0:
        source = calibration_placeholders(layers, checkpoint, precision.kv_cache_calibration_tokens)
    else:
        source = install(model, layers, checkpoint, precision.quantization_param_path, get_tp_rank(),
                         get_tp_size(), precision.kv_cache_dtype)
    log.info("fp8 KV cache (%s): k/v scales from %s", precision.kv_cache_dtype, source)
    return source
