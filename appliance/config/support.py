"""What this build cannot honour yet: the ONE list. A setting that matches an entry is rejected at start-up
(`check_supported` -> messages; the runtime refuses to start) and reported as a warning by `appliance validate`.

When a feature lands, delete its entry here, then run `appliance schema` (docs/parameters.md lists these and a
test fails on drift). Nothing accepted is silently ignored.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.config.errors import Problem
from appliance.config.parser_names import REASONING_PARSERS, TOOL_CALL_PARSERS

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig


@dataclass(frozen=True)
class Unsupported:
    path: str  # the key path the message points at
    applies: Callable[[ApplianceConfig], bool]
    message: str


def _importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _parser_missing(kind: str, name: str | None) -> bool:
    """Whether the build lacks the named parser (config/parser_names.py lists the ones it has)."""
    return name is not None and name not in (REASONING_PARSERS if kind == "reasoning" else TOOL_CALL_PARSERS)


def _calibrating(c: ApplianceConfig) -> bool:
    return c.precision.kv_cache_calibration_tokens > 0


# What the host tier of this build is (engine/host_tier.py): blocks copied to host memory when the device evicts
# them (SGLang's write_back, the default) or once they are cached (write_through), per-layer tensors shaped like the device cache (layer_first) moved by plain async
# copies (direct), sized by host_cache_size_gb or host_cache_ratio. Behind it, optionally, the disk tier
# (engine/disk_tier.py: disk_cache, or SGLang's / TokenSpeed's storage backend `file`, in disk_cache_dir, of
# disk_cache_size_gb), whose fetches complete before the step that needs them (prefetch policy wait_complete). Any
# other choice of these keys is refused (other storage backends, their extra config, other prefetch policies).
_HOST_TIER_HONOURED = {"host_cache_write_policy": (None, "write_back", "write_through"), "host_cache_io_backend": (None, "direct"),
                       "host_cache_mem_layout": (None, "layer_first"),
                       "host_cache_storage_backend": (None, "file"),
                       "host_cache_storage_prefetch_policy": (None, "wait_complete")}
_HOST_TIER_FREE = ("host_cache", "host_cache_ratio", "host_cache_size_gb", "disk_cache", "disk_cache_dir",
                   "disk_cache_size_gb")  # any value (checks.py holds them consistent)


def _host_tier_set(c: ApplianceConfig) -> bool:
    cache, defaults = c.cache, type(c.cache)()
    for k in type(cache).model_fields:
        if k in _HOST_TIER_FREE or not k.startswith("host_cache"):
            continue
        value = getattr(cache, k)
        if value not in _HOST_TIER_HONOURED.get(k, (getattr(defaults, k),)):
            return True
    return cache.host_cache and not cache.enable_prefix_caching


def _disk_tier_incomplete(c: ApplianceConfig) -> bool:
    """The disk tier (disk_cache or the storage backend `file`) without the host tier, a directory or a size."""
    cache = c.cache
    if not (cache.disk_cache or cache.host_cache_storage_backend == "file"):
        return False
    return not (cache.host_cache and cache.disk_cache_dir and cache.disk_cache_size_gb)


UNSUPPORTED: list[Unsupported] = [
    Unsupported("speculative.algorithm", lambda c: c.speculative.algorithm in ("DFLASH", "DSPARK"),
                "DFLASH and DSPARK drafting are not supported in this build; EAGLE, EAGLE3, STANDALONE, NGRAM and "
                "MTP are"),
    Unsupported("speculative.eagle_topk",
                lambda c: c.speculative.eagle_topk > 1 and c.speculative.algorithm == "NGRAM",
                "draft trees (eagle_topk > 1) are drafted by EAGLE, EAGLE3, STANDALONE and MTP; NGRAM proposes one "
                "chain"),
    Unsupported("speculative.eagle_topk",
                lambda c: c.speculative.eagle_topk > 1 and c.speculative.algorithm is not None and c.overlap_enabled(),
                "draft trees (eagle_topk > 1) run the synchronous loop in this build: set scheduler.enable_overlap "
                "= false"),
    Unsupported("speculative.num_draft_tokens",
                lambda c: c.speculative.algorithm is not None and c.speculative.eagle_topk == 1
                and c.speculative.effective_num_draft_tokens != c.speculative.num_steps + 1,
                "a draft chain (eagle_topk 1) verifies num_steps + 1 tokens (leave num_draft_tokens unset)"),
    Unsupported("speculative.num_draft_tokens",
                lambda c: c.speculative.algorithm is not None and c.speculative.eagle_topk > 1
                and (c.speculative.effective_num_draft_tokens > 64
                     or c.speculative.eagle_topk * (c.speculative.num_steps - 1) > 64),
                "a draft tree's mask row is one 64-bit word in this build: num_draft_tokens and eagle_topk * "
                "(num_steps - 1) must be at most 64"),
    Unsupported("speculative.draft_model_quantization", lambda c: c.speculative.draft_model_quantization != "unquant",
                "the drafter's weights are used as stored in this build (unquant)"),
    Unsupported("backends.drafter_attention",
                lambda c: c.backends.drafter_attention not in (None, "auto", "torch", "triton")
                or (c.speculative.algorithm == "MTP" and c.backends.drafter_attention not in (None, c.backends.attention)),
                "the drafter's attention runs on auto, torch or triton in this build (MTP's layers on "
                "backends.attention)"),
    Unsupported("backends.draft_moe",
                lambda c: c.backends.draft_moe not in (None, "auto", "torch", "triton")
                or (c.speculative.algorithm == "MTP" and c.backends.draft_moe not in (None, c.backends.moe)),
                "the draft model's MoE runs on auto, torch or triton in this build (MTP's layers on backends.moe)"),
    Unsupported("precision.quantization",
                lambda c: c.precision.quantization not in (None, "fp8", "w8a8_fp8", "modelopt", "compressed-tensors"),
                "only fp8 quantization (fp8: block fp8 or online; w8a8_fp8; modelopt and compressed-tensors fp8 "
                "checkpoints) is supported in this build"),
    Unsupported("precision.moe_weight_format",
                lambda c: c.precision.moe_weight_format == "mxfp4"
                and (c.backends.moe not in ("auto", "triton") or not _importable("triton")),
                "MXFP4 experts run on the Triton fused MoE only: backends.moe auto or triton, with the triton "
                "package installed (or precision.moe_weight_format = dequantized)"),
    Unsupported("precision.kv_cache_dtype", lambda c: c.precision.kv_cache_dtype == "nvfp4",
                "nvfp4 KV caches are not supported in this build (fp8, fp8_e4m3 and fp8_e5m2 are)"),
    Unsupported("precision.kv_cache_dtype",
                lambda c: c.precision.kv_cache_dtype.startswith("fp8") and c.backends.attention == "flashinfer",
                "an fp8 KV cache runs on the torch and triton attention backends in this build, not flashinfer"),
    Unsupported("precision.kv_cache_high_precision_layers",
                lambda c: c.precision.kv_cache_high_precision_layers > 0
                and not c.precision.kv_cache_dtype.startswith("fp8"),
                "16-bit KV layers apply to an fp8 KV cache (set precision.kv_cache_dtype to fp8)"),
    Unsupported("precision.kv_cache_quant_method", lambda c: c.precision.kv_cache_quant_method == "per_token_head",
                "per_token_head (dynamic per-token, per-head KV scales) is not built; an fp8 KV cache takes static "
                "per-layer scales (kv_cache_quant_method none) from the checkpoint, quantization_param_path or "
                "kv_cache_calibration_tokens"),
    Unsupported("precision.kv_cache_calibration_tokens",
                lambda c: _calibrating(c) and not c.precision.kv_cache_dtype.startswith("fp8"),
                "online KV scale calibration applies to an fp8 KV cache (set precision.kv_cache_dtype to fp8)"),
    Unsupported("precision.kv_cache_calibration_tokens",
                lambda c: _calibrating(c) and c.precision.quantization_param_path is not None,
                "KV scales come from one source: online calibration or precision.quantization_param_path, not both"),
    Unsupported("precision.kv_cache_calibration_tokens",
                lambda c: _calibrating(c) and c.cache.host_cache,
                "online KV scale calibration rescales the device cache as the scales grow; blocks copied to the host "
                "tier meanwhile would keep the old scale (turn cache.host_cache off, or use fixed scales)"),
    Unsupported("precision.quantization_param_path",
                lambda c: c.precision.quantization_param_path is not None
                and not c.precision.kv_cache_dtype.startswith("fp8"),
                "KV cache scaling factors apply to an fp8 KV cache (set precision.kv_cache_dtype to fp8)"),
    Unsupported("parallelism.enable_expert_parallel",
                lambda c: c.parallelism.enable_expert_parallel and c.parallelism.effective_ep != c.parallelism.tp,
                "expert parallelism spans one tensor-parallel group in this build: ep must equal tp (not tp x dp)"),
    Unsupported("parallelism.dense_tp", lambda c: c.parallelism.dense_tp not in (None, c.parallelism.tp),
                "a dense-layer TP size different from tp is not supported in this build"),
    Unsupported("parallelism.moe_tp", lambda c: c.parallelism.moe_tp not in (
                    None, 1 if c.parallelism.enable_expert_parallel else c.parallelism.tp),
                "an MoE TP size other than tp (or 1 with expert parallelism) is not supported in this build"),
    Unsupported("parallelism.nnodes", lambda c: c.parallelism.nnodes > 1 and c.parallelism.dp > 1,
                "several nodes run tensor parallelism across nodes (dp = 1); data-parallel replicas across nodes "
                "are not supported in this build"),
    Unsupported("parallelism.pp", lambda c: c.parallelism.pp > 1,
                "pipeline parallelism is not supported in this build (tp x dp only)"),
    Unsupported("parallelism.dcp", lambda c: c.parallelism.dcp > 1,
                "decode context parallelism is not supported in this build"),
    Unsupported("cache.host_cache", _host_tier_set,
                "this build's host tier copies blocks on eviction or once cached (write_policy write_back or "
                "write_through; write_through_selective is not available; io_backend direct, "
                "mem_layout layer_first), is sized by host_cache_size_gb or host_cache_ratio and sits under the prefix "
                "cache (enable_prefix_caching); its one storage backend is `file` (the disk tier: disk_cache_dir, "
                "disk_cache_size_gb, prefetch policy wait_complete, no extra storage config)"),
    Unsupported("cache.disk_cache", _disk_tier_incomplete,
                "the disk tier sits behind the host tier: it needs cache.host_cache, cache.disk_cache_dir and "
                "cache.disk_cache_size_gb"),
    Unsupported("scheduler.preemption_mode",
                lambda c: c.scheduler.preemption_mode != "recompute"
                and not (c.cache.host_cache and c.cache.enable_prefix_caching),
                "swap and auto keep preempted requests' KV in the host tier: they need cache.host_cache (with "
                "enable_prefix_caching); recompute does not"),
    Unsupported("multimodal", lambda c: not c.multimodal.text_only(),
                "image and video inputs are not supported in this build (text only)"),
    Unsupported("api.reasoning_parser", lambda c: _parser_missing("reasoning", c.api.reasoning_parser),
                "this reasoning parser is not implemented in this build (config/parser_names.py lists the ones "
                "that are)"),
    Unsupported("api.tool_call_parser", lambda c: _parser_missing("tool", c.api.tool_call_parser),
                "this tool-call parser is not implemented in this build (config/parser_names.py lists the ones "
                "that are)"),
    Unsupported("backends.attention",
                lambda c: c.backends.attention not in ("auto", "torch", "triton", "flashinfer"),
                "only the auto, torch, triton and flashinfer attention backends exist in this build"),
    Unsupported("backends.attention",
                lambda c: c.backends.attention == "flashinfer" and not _importable("flashinfer"),
                "the flashinfer attention backend needs the flashinfer-python package (0.6.14, the `flashinfer` "
                "extra), which is not installed here"),
    Unsupported("backends.moe", lambda c: c.backends.moe not in ("auto", "torch", "triton"),
                "only the auto, torch and triton MoE backends exist in this build"),
    Unsupported("backends.linear", lambda c: c.backends.linear != "auto",
                "only the auto dense GEMM backend exists in this build"),
    Unsupported("backends.all2all", lambda c: c.backends.all2all != "auto",
                "MoE all-to-all backends are not supported in this build"),
    Unsupported("backends.deepep_mode", lambda c: c.backends.deepep_mode != "auto",
                "DeepEP is not supported in this build"),
    # greedy is TokenSpeed's argmax-only backend: honouring it would mean ignoring (or refusing) every request's
    # temperature; auto and torch already decode temperature-0 rows with a plain argmax
    Unsupported("backends.sampling", lambda c: c.backends.sampling not in ("auto", "torch"),
                "only the auto and torch sampling backends exist in this build (greedy requests, temperature 0, "
                "take an argmax path with either)"),
    Unsupported("backends.dp_sampling", lambda c: c.backends.dp_sampling,
                "data-parallel sampling is not supported in this build"),
    # tp all-reduces are torch.distributed's (gloo on the CPU, nccl on GPUs); no custom CUDA-IPC one-shot kernel
    Unsupported("backends.enable_allreduce_fusion", lambda c: c.backends.enable_allreduce_fusion,
                "all-reduce fusion is not supported in this build"),
    Unsupported("backends.comm_fusion_max_num_tokens", lambda c: c.backends.comm_fusion_max_num_tokens is not None,
                "communication fusion is not supported in this build"),
    # MLA itself runs (layers/mla.py): absorbed decode, and a prefill that expands the whole context's latents
    Unsupported("backends.mla_chunk_multiplier", lambda c: c.backends.mla_chunk_multiplier is not None,
                "MLA prefill expands the whole context at once in this build; it has no chunks to size"),
    Unsupported("backends.enable_mla_l1_5_cache", lambda c: c.backends.enable_mla_l1_5_cache,
                "TokenSpeed's MLA L1.5 cache is not implemented in this build"),
    Unsupported("scheduler.policy", lambda c: c.scheduler.policy == "slo" and c.scheduler.chunked_prefill_size == -1,
                "the slo policy sizes prefill chunks to the decodes' deadlines: it needs chunked prefill "
                "(scheduler.chunked_prefill_size > 0)"),
    Unsupported("api.enable_custom_logit_processor", lambda c: c.api.enable_custom_logit_processor,
                "custom logit processors are not supported in this build"),
    Unsupported("api.stream_output", lambda c: c.api.stream_output,
                "disjoint streaming segments (stream_output) are not supported in this build"),
    Unsupported("model.load_format", lambda c: c.model.load_format not in ("auto", "pt", "safetensors", "dummy"),
                "only the auto, pt, safetensors and dummy load formats are supported in this build"),
    Unsupported("model.tokenizer_mode", lambda c: c.model.tokenizer_mode != "auto",
                "only Hugging Face fast tokenizers (tokenizer_mode auto) are supported in this build"),
    Unsupported("model.config_format", lambda c: c.model.config_format == "mistral",
                "mistral-format model configs (params.json) are not supported in this build"),
    Unsupported("observability.metrics_reporters",
                lambda c: c.observability.metrics_reporters != ["prometheus"],
                "only the prometheus metrics reporter exists in this build"),
]


def unsupported_problems(config: ApplianceConfig) -> list[Problem]:
    return [Problem(u.path, u.message + " (remove the setting or use its default)", "warning")
            for u in UNSUPPORTED if u.applies(config)]


def check_supported(config: ApplianceConfig) -> list[str]:
    """Messages for every setting this build cannot honour; the runtime refuses to start when any is returned."""
    return [f"{p.path}: {p.message}" for p in unsupported_problems(config)]
