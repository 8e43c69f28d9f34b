"""What a ModelRunner settles before it builds anything: device, attention backend, context length, EOS ids,
and the settings this executor refuses (never silently dropped)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from appliance.executor import speculative

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from appliance.config.schema import ApplianceConfig


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device = cuda but no CUDA device is visible")
    return torch.device(name)


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto`: triton on a GPU when its kernels are registered, else the torch reference. Never flashinfer: it is
    optional (an extra package, JIT compiles on first use, eager only), so it runs only when named; named and not
    importable, it fails here, at start-up, with the missing package in the message."""
    from appliance.kernels import registry
    from appliance.layers.kernels import ATTENTION_OPS

    if name != "auto":
        try:
            for op in ATTENTION_OPS:
                registry.get(op, name)
        except (KeyError, ImportError) as exc:
            raise ValueError(f"backends.attention = {name!r} is not available here: {exc}") from exc
        if name == "flashinfer" and device.type != "cuda":
            raise ValueError(f"backends.attention = 'flashinfer' needs a CUDA device (model.device resolved to "
                             f"{device.type}); use triton or torch")
        return name
    if device.type == "cuda":
        try:
            for op in ATTENTION_OPS:
                registry.get(op, "triton")
            return "triton"
        except (KeyError, ImportError):
            pass
    return "torch"


def model_kwargs(model_cls: type, config: ApplianceConfig, attention_backend: str) -> dict[str, Any]:
    """The MoE keywords of a model's constructor (model_loader and memory_check build it alike): moe_backend
    (backends.moe: the fused_moe kernels, models/mixtral.py), and moe_weight_format where it is not the default.
    `mxfp4` needs a model whose experts ship in MXFP4 (`mxfp4_experts`) and the Triton MoE: ValueError at
    start-up otherwise."""
    kwargs: dict[str, Any] = {}
    if getattr(model_cls, "is_moe", False):
        from appliance.layers.moe import resolve_moe_backend

        kwargs["moe_backend"] = resolve_moe_backend(config.backends.moe, attention_backend)
    fmt = config.precision.moe_weight_format
    if fmt == "dequantized":
        return kwargs
    if not getattr(model_cls, "mxfp4_experts", False):
        raise ValueError(f"precision.moe_weight_format = {fmt!r} applies to models whose experts ship in MXFP4 "
                         f"(gpt-oss); {model_cls.__name__} has none")
    if kwargs.get("moe_backend") != "triton":
        raise ValueError(f"precision.moe_weight_format = {fmt!r} runs on the Triton fused MoE, but backends.moe "
                         f"resolved to {kwargs.get('moe_backend')!r} (auto follows the attention backend, here "
                         f"{attention_backend!r}: triton on a GPU)")
    return {**kwargs, "moe_weight_format": fmt}


def bind_decode_kernels(model: torch.nn.Module, backend: str, decode_chain: bool) -> None:
    """Decode-sized batches stream weights through `backend`'s GEMV (layers/linear.py use_gemv_kernel) and, where
    backends.decode_chain is on and every layer is served, through the fused decode chain (layers/decode_chain.py);
    off, the model keeps no chain. The model runner calls it on CUDA devices."""
    from appliance.layers.linear import use_gemv_kernel

    use_gemv_kernel(model, backend)
    inner = getattr(model, "model", None)
    if hasattr(inner, "use_decode_chain"):
        if decode_chain:
            inner.use_decode_chain(backend)
        else:
            inner.chain = None


def resolve_max_model_len(requested: int | None, hf_config: PretrainedConfig, windowed: bool = False) -> int:
    """`windowed`: the model applies its sliding windows (Gemma 3, gpt-oss), so sliding_window caps nothing."""
    limit = int(getattr(hf_config, "max_position_embeddings", 0) or 0) or None
    window = getattr(hf_config, "sliding_window", None)
    if window and getattr(hf_config, "use_sliding_window", True) and not windowed:
        # attention here is full attention: beyond the window the model would see more than it was trained to
        limit = min(limit or window, int(window))
    if requested is None:
        if limit is None:
            raise ValueError("the model config has no max_position_embeddings; set model.max_model_len")
        return limit
    if limit is not None and requested > limit:
        raise ValueError(f"model.max_model_len={requested} exceeds the model's limit {limit} "
                         f"(max_position_embeddings / sliding_window); raise it through hf_overrides if you mean to")
    return requested


def read_eos_token_ids(model_dir: Path | None, hf_config: PretrainedConfig) -> list[int]:
    """EOS ids from generation_config.json (which may list several) and config.json."""
    ids: list[int] = []
    sources: list[Any] = [getattr(hf_config, "eos_token_id", None)]
    gen = model_dir / "generation_config.json" if model_dir else None
    if gen is not None and gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for src in sources:
        for t in ([src] if isinstance(src, int) else list(src or [])):
            if t not in ids:
                ids.append(int(t))
    return ids


def _check_supported(config: ApplianceConfig, device: torch.device) -> None:
    """Settings this executor cannot honour are errors (or, for CUDA graphs, a warning), never silently dropped."""
    sampling = config.backends.sampling
    if sampling in ("flashinfer", "flashinfer_full"):
        # flashinfer's samplers draw from their own Philox streams: a seeded request would not give the tokens the
        # torch and Triton samplers give (they share per-request (seed, step) uniforms bit for bit), and min_p with
        # top-k/top-p needs a chain of its renorm kernels; its JIT compile also takes ~4 minutes per fresh machine
        raise ValueError(f"backends.sampling={sampling!r} is not supported by this executor: flashinfer's samplers "
                         "are not wired (its attention kernels are: backends.attention = flashinfer); "
                         "supported: auto, torch")
    if sampling not in ("auto", "torch"):
        raise ValueError(f"backends.sampling={sampling!r} is not supported by this executor yet "
                         "(supported: auto, torch)")
    speculative.check_settings(config)  # a chain (eagle_topk 1), no overlap
