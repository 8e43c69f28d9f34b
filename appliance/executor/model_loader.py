"""Finding a checkpoint on local disk, reading its config and dtype, and streaming its tensors into a model.

Nothing here touches the network: a repo id resolves through a local Hugging Face cache (download_dir, or the
standard HF cache) at the requested revision, and a missing model is an error naming where we looked.
"""
from __future__ import annotations

import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from appliance.config.hf_cache import ModelNotFound, resolve_model_dir  # noqa: F401  (re-exported)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_hf_config(model_dir: Path, hf_overrides: dict[str, Any] | None = None,
                   trust_remote_code: bool = False) -> Any:
    """The transformers config of a local model with `hf_overrides` applied (unknown keys are added)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
    for key, value in (hf_overrides or {}).items():
        current = getattr(cfg, key, None)
        if isinstance(current, dict) and isinstance(value, dict):
            value = {**current, **value}  # nested override (e.g. rope_parameters) merges
        setattr(cfg, key, value)
    return cfg


def resolve_dtype(dtype: str, hf_config: PretrainedConfig, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype, with float32 on the CPU in place of half precision."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(declared, str):
        declared = _DTYPES.get(declared, torch.float32)
    chosen = declared if isinstance(declared, torch.dtype) and declared in _DTYPES.values() else torch.float32
    if device.type == "cpu" and chosen in (torch.float16, torch.bfloat16):
        return torch.float32
    return chosen


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    return sorted(Path(p) for p in glob.glob(str(model_dir / "*.safetensors")))


def _pt_files(model_dir: Path) -> list[Path]:
    index = model_dir / "pytorch_model.bin.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / f for f in sorted(set(weight_map.values()))]
    return sorted(Path(p) for p in glob.glob(str(model_dir / "*.bin")) + glob.glob(str(model_dir / "*.pt"))
                  if not Path(p).name.startswith("training_args"))


def iterate_weights(model_dir: Path, load_format: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor, from safetensors (auto prefers them) or torch pickles."""
    if load_format not in ("auto", "safetensors", "pt"):
        raise ValueError(f"load_format {load_format!r} cannot be read from a checkpoint (use auto, safetensors, "
                         f"pt or dummy)")
    st = _safetensors_files(model_dir) if load_format in ("auto", "safetensors") else []
    if st:
        from safetensors import safe_open

        from appliance.executor.distributed import checkpoint_tensor

        for f in st:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118  (a safetensors handle, not a dict)
                    yield name, checkpoint_tensor(handle, name)  # with tp > 1, read only this rank's slices
        return
    if load_format == "safetensors":
        raise ModelNotFound(f"load_format safetensors: no *.safetensors files in {model_dir}")
    pt = _pt_files(model_dir)
    if not pt:
        raise ModelNotFound(f"no weights in {model_dir} (looked for *.safetensors, *.bin, *.pt)")
    for f in pt:
        state = torch.load(str(f), map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()


def load_weights(model: nn.Module, model_dir: Path, load_format: str) -> None:
    """Fill every parameter from the checkpoint; a parameter left unfilled is an error, not random weights."""
    loaded = model.load_weights(iterate_weights(model_dir, load_format))  # type: ignore[operator]
    tied = {"lm_head.weight"} if getattr(model, "tie_word_embeddings", False) else set()
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded and n not in tied)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks parameters: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights with the real shapes (benchmarks): small uniform values keep activations finite.
    Drawn on the parameters' own device, so an 8B dummy model starts in seconds."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        gen = generators.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        if param.element_size() == 1:  # fp8 (layers/fp8.py): torch draws no random numbers in it; draw, then cast
            # Use the whole e4m3 range, as real quantised weights do (each tile's amax maps to 448): values drawn
            # near zero would round to zeros, which run faster than real data. The scales below bring the
            # effective weights back to the same small magnitude as the other dummy weights.
            flat = param.data.view(-1)  # in slabs: a float32 copy of a whole expert stack would not fit
            for start in range(0, flat.numel(), 1 << 26):
                part = flat[start : start + (1 << 26)]
                part.copy_(torch.empty(part.shape, device=param.device).uniform_(-448.0, 448.0, generator=gen))
        elif name.endswith("weight_scale_inv"):
            param.data.uniform_(0.5e-3 / 448.0, 1e-3 / 448.0, generator=gen)
        else:
            param.data.uniform_(-1e-3, 1e-3, generator=gen)


def apply_quantization(model: nn.Module, quantization: str | None, hf_config: PretrainedConfig, backend: str) -> None:
    """precision.quantization after the weights are in (loaded or dummy): "fp8" on a float checkpoint quantizes
    the linear layers and experts to e4m3 with 128x128 tile scales (the layout DeepSeek-V3 ships, run by the
    same block-scaled GEMMs); on a checkpoint that ships block fp8 it only confirms the format."""
    from appliance.layers.fp8 import online_fp8_needed, quantize_model_fp8

    if online_fp8_needed(quantization, hf_config):
        quantize_model_fp8(model, backend)
