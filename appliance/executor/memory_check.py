"""Do the model's weights fit? Checked at start-up, before any weight is allocated, so that a model too large for
the machine fails in seconds with the shortfall named, not minutes later with an allocator error.

The estimate builds the model on the `meta` device (shapes, no storage) with this rank's tensor / expert
parallel split and sums its parameters and buffers: the same code that will build the real model, so fp8
weights and their tile scales, MLA, shared experts and MTP layers count exactly as they will be allocated.
Online fp8 quantization (a float checkpoint with precision.quantization = "fp8") loads the weights in the
model dtype first and quantizes them afterwards, so its peak is the unquantized size, and that is what is checked.

The budget: on a GPU, cache.gpu_memory_utilization of its total memory (and no more than is free now); on the
CPU, the machine's available memory (MemAvailable) shared by the workers of this node.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from appliance.config.schema import ApplianceConfig

GIB = float(1 << 30)


class WeightMemoryError(RuntimeError):
    """The model's weights alone exceed this worker's memory budget."""


@dataclass(frozen=True)
class WeightEstimate:
    bytes_per_rank: int  # what this rank allocates while loading (the peak, for online quantization)
    final_bytes_per_rank: int  # what stays after loading (smaller when fp8 is applied after loading)
    dtypes: tuple[str, ...]  # the parameter dtypes that make up the weights, largest share first


@dataclass(frozen=True)
class MemoryBudget:
    bytes: int
    explanation: str  # "GPU 0 has 79.1 GiB total and 0.88 of it (gpu_memory_utilization) is 69.6 GiB"


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (shared tensors once)."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _dtype_shares(module: torch.nn.Module) -> tuple[str, ...]:
    shares: dict[str, int] = {}
    for p in module.parameters():
        name = str(p.dtype).removeprefix("torch.")
        shares[name] = shares.get(name, 0) + p.numel() * p.element_size()
    return tuple(sorted(shares, key=lambda k: -shares[k]))


def build_on_meta(model_cls: type[torch.nn.Module], hf_config: PretrainedConfig, dtype: torch.dtype,
                  kwargs: dict[str, Any]) -> torch.nn.Module:
    """The model as ModelRunner builds it (default dtype = the model dtype), with no storage behind it."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return model_cls(hf_config, **kwargs)
    finally:
        torch.set_default_dtype(previous)


def estimate_weights(model_cls: type[torch.nn.Module], hf_config: PretrainedConfig, dtype: torch.dtype,
                     kwargs: dict[str, Any], quantization: str | None = None,
                     model_dir: Path | None = None) -> WeightEstimate:
    """Weight bytes of this rank's shard (parallel state as initialised now)."""
    from appliance.executor.model_loader import apply_quantization, prepare_quantization

    model = build_on_meta(model_cls, hf_config, dtype, kwargs)
    scaled = prepare_quantization(model, quantization, hf_config, model_dir)  # fp8 checkpoints load as fp8
    peak = module_bytes(model)
    apply_quantization(model, quantization, hf_config, "torch", scaled)  # on meta tensors: the final layout
    return WeightEstimate(peak, module_bytes(model), _dtype_shares(model))


def _mem_available() -> int:
    """MemAvailable of /proc/meminfo (Linux); else the physical memory (os.sysconf)."""
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def local_workers(parallelism: Any) -> int:
    if parallelism.nprocs_per_node is not None:
        return int(parallelism.nprocs_per_node)
    return max(1, int(parallelism.effective_world_size) // max(1, int(parallelism.nnodes)))


def memory_budget(device: torch.device, utilization: float, workers_here: int) -> MemoryBudget:
    if device.type == "cuda":
        # an engine this process dropped earlier leaves its blocks in torch's caching allocator: give them back
        # first, so they count as free (mem_get_info sees reserved memory as used)
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        share = int(total * utilization)
        index = device.index if device.index is not None else torch.cuda.current_device()
        text = (f"GPU {index} has {total / GIB:.1f} GiB total and {utilization:g} of it (gpu_memory_utilization) "
                f"is {share / GIB:.1f} GiB")
        if free < share:  # another process holds part of it
            text += f", of which only {free / GIB:.1f} GiB is free now"
        return MemoryBudget(min(share, free), text)
    avail = _mem_available()
    share = avail // max(1, workers_here)
    text = f"this machine has {avail / GIB:.1f} GiB of memory available"
    if workers_here > 1:
        text += f", shared by its {workers_here} workers: {share / GIB:.1f} GiB each"
    return MemoryBudget(share, text)


def describe(hf_config: PretrainedConfig, estimate: WeightEstimate, quantization: str | None, tp: int, ep: int) -> str:
    arch = (getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "model")])[0]
    parts = [str(arch), quantization or "/".join(estimate.dtypes[:2]) or "?", f"tp={tp}"]
    if ep > 1:
        parts.append(f"ep={ep}")
    return ", ".join(parts)


def shortfall_message(need: int, budget: MemoryBudget, what: str, device: torch.device,
                      estimate: WeightEstimate, mxfp4_experts: bool = False) -> str:
    unit = "GPU" if device.type == "cuda" else "worker"
    text = f"model weights need {need / GIB:.1f} GiB per {unit} ({what})"
    if estimate.final_bytes_per_rank != need:
        text += (f" while loading (they are quantized to {estimate.final_bytes_per_rank / GIB:.1f} GiB after "
                 f"loading)")
    text += f", but {budget.explanation}: {(need - budget.bytes) / GIB:.1f} GiB short; "
    hints = ["use more GPUs (parallelism.tp, with parallelism.enable_expert_parallel for MoE models)"
             if device.type == "cuda" else "use a machine with more memory or more nodes (parallelism.nnodes)"]
    if device.type == "cuda":
        hints.append("raise cache.gpu_memory_utilization")
    if mxfp4_experts:  # experts that ship in MXFP4, dequantized here
        hints.append('keep the experts in MXFP4 (precision.moe_weight_format = "mxfp4", about a quarter of their '
                     'bytes)')
    elif estimate.dtypes and estimate.dtypes[0] in ("float32", "bfloat16", "float16"):
        hints.append('quantize the weights (precision.quantization = "fp8")')
    hints.append("or pick a smaller model")
    return text + ", ".join(hints)


def check_weight_memory(config: ApplianceConfig, hf_config: PretrainedConfig, dtype: torch.dtype,
                        device: torch.device, backend: str, model_dir: Path | None = None) -> WeightEstimate:
    """Raise WeightMemoryError naming the shortfall when this rank's weights exceed its memory budget.
    Called by ModelRunner right before it builds the model (the parallel state is initialised by then)."""
    from appliance.executor.runner_setup import model_kwargs
    from appliance.layers.parallel_state import get_ep_size, get_tp_size
    from appliance.models.registry import model_class

    cls = model_class(hf_config)
    kwargs: dict[str, Any] = {"backend": backend, **model_kwargs(cls, config, backend)}
    quantization = config.precision.quantization
    estimate = estimate_weights(cls, hf_config, dtype, kwargs, quantization, model_dir)
    budget = memory_budget(device, float(config.cache.gpu_memory_utilization), local_workers(config.parallelism))
    if estimate.bytes_per_rank > budget.bytes:
        what = describe(hf_config, estimate, quantization, get_tp_size(), get_ep_size())
        dequantized_mxfp4 = (getattr(cls, "mxfp4_experts", False)
                             and config.precision.moe_weight_format == "dequantized")
        raise WeightMemoryError(shortfall_message(estimate.bytes_per_rank, budget, what, device, estimate,
                                                  dequantized_mxfp4))
    return estimate
