"""Finding a checkpoint on local disk, reading its config and dtype, and streaming its tensors into a model.

Nothing here touches the network: a repo id resolves through a local Hugging Face cache (download_dir, or the
standard HF cache) at the requested revision, and a missing model is an error naming where we looked.
"""
from __future__ import annotations

import contextlib
import glob
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from appliance.config.hf_cache import ModelNotFound, resolve_model_dir  # noqa: F401  (re-exported)
from appliance.executor.kv_scales import CheckpointKVScales
from appliance.executor.runner_setup import bind_decode_kernels, model_kwargs
from appliance.executor.startup import STARTUP
from appliance.models.config_json import read_config_json
from appliance.models.registry import model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from appliance.executor.model_runner import ModelRunner
    from appliance.layers.fp8_scaled import Fp8ScaledConfig

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# transformers config properties whose setters do more than set the attribute (rope_scaling re-derives
# rope_parameters): an override of one is applied by transformers itself
SETTER_KEYS = frozenset(("rope_scaling", "torch_dtype", "num_labels", "output_attentions", "name_or_path",
                         "use_return_dict"))


def load_hf_config(model_dir: Path, hf_overrides: dict[str, Any] | None = None,
                   trust_remote_code: bool = False) -> Any:
    """The transformers config of a local model with `hf_overrides` applied (unknown keys are added). The dense
    model types' config.json is read without importing transformers (models/config_json.py: the same attributes,
    seconds less at start-up)."""
    cfg: Any = None
    if not SETTER_KEYS & set(hf_overrides or {}):
        cfg = read_config_json(model_dir)  # None for remote code (auto_map) and whatever it does not cover
    if cfg is None:
        cfg = _auto_config(model_dir, trust_remote_code)
    for key, value in (hf_overrides or {}).items():
        current = getattr(cfg, key, None)
        if isinstance(current, dict) and isinstance(value, dict):
            value = {**current, **value}  # nested override (e.g. rope_parameters) merges
        setattr(cfg, key, value)
    return cfg


def _auto_config(model_dir: Path, trust_remote_code: bool) -> PretrainedConfig:
    from transformers import AutoConfig

    try:
        cfg = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code, local_files_only=True)
    except ValueError:
        cfg = _config_by_architecture(model_dir)
        if cfg is None:
            raise
    return _text_config(cfg)


# multimodal checkpoints served as text models: their text_config is the model's config
TEXT_ONLY_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)


def _text_config(cfg: PretrainedConfig) -> PretrainedConfig:
    archs = list(getattr(cfg, "architectures", None) or [])
    text = getattr(cfg, "text_config", None)
    if text is None or not any(a in TEXT_ONLY_ARCHITECTURES for a in archs):
        return cfg
    text.architectures = archs  # the registry picks the class that reads the multimodal checkpoint's names
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if getattr(text, key, None) is None and getattr(cfg, key, None) is not None:
            setattr(text, key, getattr(cfg, key))
    return text


def _config_by_architecture(model_dir: Path) -> PretrainedConfig | None:
    """A checkpoint whose model_type transformers does not know, but whose architecture it does (Kimi-K2 ships
    model_type kimi_k2 with remote code for DeepseekV3ForCausalLM): its config.json read by that architecture's
    config class, without running the checkpoint's code. None when the architecture is not one we serve."""
    import transformers

    from appliance.models.registry import MODELS

    path = model_dir / "config.json"
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    for arch in raw.get("architectures") or []:
        config_cls = getattr(transformers, arch.removesuffix("ForCausalLM") + "Config", None)
        if arch in MODELS and config_cls is not None:
            return config_cls.from_dict({k: v for k, v in raw.items() if k not in ("model_type", "auto_map")})
    return None


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


def load_weights(model: nn.Module, model_dir: Path, load_format: str) -> CheckpointKVScales:
    """Fill every parameter from the checkpoint; a parameter left unfilled is an error, not random weights.
    Returns the KV cache scales the checkpoint ships (no parameters: kv_scales.install gives them to the layers
    of an fp8 cache)."""
    kv = CheckpointKVScales()
    loaded = model.load_weights(kv.filter(iterate_weights(model_dir, load_format)))  # type: ignore[operator]
    tied = {"lm_head.weight"} if getattr(model, "tie_word_embeddings", False) else set()
    missing = sorted(n for n, _ in model.named_parameters() if n not in loaded and n not in tied)
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks parameters: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''}")
    return kv


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights with the real shapes (benchmarks): small uniform values keep activations finite.
    Drawn on the parameters' own device, so an 8B dummy model starts in seconds."""
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        gen = generators.setdefault(param.device, torch.Generator(device=param.device).manual_seed(seed))
        if param.dtype == torch.uint8:  # MXFP4 experts (kernels/mxfp4.py): every code, and scales that make them
            # as small as the other dummy weights (a mean magnitude of ~2.3 times 2^-12 .. 2^-10)
            low, high = (115, 118) if name.endswith("_scales") else (0, 256)
            param.data.random_(low, high, generator=gen)
        elif param.element_size() == 1:  # fp8 (layers/fp8.py): torch draws no random numbers in it; draw, then cast
            # Use the whole e4m3 range, as real quantised weights do (each tile's amax maps to 448): values drawn
            # near zero would round to zeros, which run faster than real data. The scales below bring the
            # effective weights back to the same small magnitude as the other dummy weights.
            flat = param.data.view(-1)  # in slabs: a float32 copy of a whole expert stack would not fit
            for start in range(0, flat.numel(), 1 << 26):
                part = flat[start : start + (1 << 26)]
                part.copy_(torch.empty(part.shape, device=param.device).uniform_(-448.0, 448.0, generator=gen))
        elif name.endswith(("weight_scale_inv", "weight_scale", "input_scale")):  # fp8 scales: positive
            param.data.uniform_(0.5e-3 / 448.0, 1e-3 / 448.0, generator=gen)
        else:
            param.data.uniform_(-1e-3, 1e-3, generator=gen)


def prepare_quantization(model: nn.Module, quantization: str | None, hf_config: PretrainedConfig,
                         model_dir: Path | None) -> Fp8ScaledConfig | None:
    """Before the weights go in: a compressed-tensors or ModelOpt fp8 checkpoint's linear layers get e4m3
    weights and scale parameters (layers/fp8_scaled.py). Returns the scaled-fp8 scheme (or None) for
    apply_quantization."""
    from appliance.layers.fp8_scaled import prepare_scaled_fp8, scaled_config

    scaled = scaled_config(quantization, hf_config, model_dir)
    if scaled is not None and not scaled.online:
        prepare_scaled_fp8(model, scaled)
    return scaled


def apply_quantization(model: nn.Module, quantization: str | None, hf_config: PretrainedConfig, backend: str,
                       scaled: Fp8ScaledConfig | None = None) -> None:
    """precision.quantization after the weights are in (loaded or dummy): "fp8" on a float checkpoint quantizes
    the linear layers and experts to e4m3 with 128x128 tile scales (the layout DeepSeek-V3 ships, run by the
    same block-scaled GEMMs); on a checkpoint that ships block fp8 it only confirms the format. "w8a8_fp8" on a
    float checkpoint (`scaled`, from prepare_quantization) quantizes the linear layers per channel."""
    if scaled is None and quantization is None:  # 16-bit, or a checkpoint's own block fp8: nothing to do here
        return  # (and the fp8 layers, which import every MoE kernel, stay unimported)
    from appliance.layers.fp8 import online_fp8_needed, quantize_model_fp8
    from appliance.layers.fp8_scaled import quantize_scaled_fp8

    if scaled is not None:
        if scaled.online:
            quantize_scaled_fp8(model, scaled)
        return
    if online_fp8_needed(quantization, hf_config):
        quantize_model_fp8(model, backend)


def build_model(runner: ModelRunner, load_format: str,
                seed: int) -> tuple[torch.nn.Module, CheckpointKVScales]:
    """The runner's model, built, its weights loaded (or drawn) and quantized, with the fp8 KV cache scales its
    checkpoint ships (none for dummy weights)."""
    cls = model_class(runner.hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(runner.dtype)
    try:
        with STARTUP.phase("building the model"), torch.device(runner.device):
            extra = model_kwargs(cls, runner.config, runner.backend)
            if getattr(cls, "builds_mtp_on_request", False):  # its MTP layer only when it drafts (qwen3_next.py)
                extra["with_mtp"] = runner.config.speculative.algorithm == "MTP"
            model = cls(runner.hf_config, backend=runner.backend, **extra)
    finally:
        torch.set_default_dtype(previous)
    quantization = runner.config.precision.quantization
    kv_scales = CheckpointKVScales()
    with STARTUP.phase("drawing dummy weights" if load_format == "dummy" else "loading weights"):
        # a compressed-tensors / ModelOpt fp8 checkpoint's layers take e4m3 weights and scales before loading
        scaled = prepare_quantization(model, quantization, runner.hf_config, runner.model_dir)
        if load_format == "dummy":
            init_dummy_weights(model, seed)
        else:
            kv_scales = load_weights(model, runner.model_dir, load_format)
    with STARTUP.phase(f"quantizing ({quantization})") if quantization else contextlib.nullcontext():
        apply_quantization(model, quantization, runner.hf_config, runner.backend, scaled)
    if runner.device.type == "cuda":
        bind_decode_kernels(model, runner.backend, runner.config.backends.decode_chain)
    return model.eval(), kv_scales
