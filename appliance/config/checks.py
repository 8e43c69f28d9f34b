"""Cross-field checks: rules that involve more than one key, and the model's own config.json when it is local.

`check_consistency` is pure (the schema's model validator runs it too); `check_model` reads files.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.config.errors import Problem

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default_model"

# Algorithms that need a separate draft checkpoint; MTP uses the target's own layers, NGRAM needs no model.
_NEEDS_DRAFT_MODEL = ("EAGLE", "EAGLE3", "DFLASH", "STANDALONE")


def resolve_model_path(path: str | None) -> str:
    """The model path the runtime loads: the embedded default model when none is configured."""
    return str(DEFAULT_MODEL_DIR) if path is None else path


def check_consistency(cfg: ApplianceConfig) -> list[Problem]:
    return [*_parallel(cfg), *_speculative(cfg), *_scheduler(cfg), *_api(cfg)]


def _parallel(cfg: ApplianceConfig) -> list[Problem]:
    p = cfg.parallelism
    out: list[Problem] = []
    product = p.tp * p.pp * p.dp
    if p.world_size is not None and p.world_size != product:
        out.append(Problem("parallelism.world_size",
                           f"world_size {p.world_size} != tp x pp x dp = {p.tp} x {p.pp} x {p.dp} = {product}"))
    if p.tp % p.dcp:
        out.append(Problem("parallelism.dcp", f"dcp {p.dcp} must divide tp {p.tp}"))
    world = p.effective_world_size
    if p.ep is not None and p.ep > 1 and not p.enable_expert_parallel:
        out.append(Problem("parallelism.ep", f"ep = {p.ep} needs enable_expert_parallel = true"))
    ep = p.effective_ep
    if world % ep:
        out.append(Problem("parallelism.ep", f"ep {ep} must divide the world size {world} (tp x pp x dp)"))
    for key, size in (("dense_tp", p.dense_tp), ("moe_tp", p.moe_tp)):
        if size is not None and world % size:
            out.append(Problem(f"parallelism.{key}", f"{key} {size} must divide the world size {world}"))
    if p.moe_tp is not None and p.enable_expert_parallel and p.moe_tp * ep > world:
        out.append(Problem("parallelism.moe_tp", f"moe_tp {p.moe_tp} x ep {ep} exceeds the world size {world}"))
    if p.node_rank >= p.nnodes:
        out.append(Problem("parallelism.node_rank", f"node_rank {p.node_rank} must be < nnodes {p.nnodes}"))
    if p.nprocs_per_node is not None and p.nprocs_per_node * p.nnodes != world:
        out.append(Problem("parallelism.nprocs_per_node",
                           f"nprocs_per_node {p.nprocs_per_node} x nnodes {p.nnodes} != world size {world}"))
    elif p.nprocs_per_node is None and world % p.nnodes:
        out.append(Problem("parallelism.nnodes", f"world size {world} is not divisible by nnodes {p.nnodes}"))
    if p.nnodes > 1 and not p.dist_init_addr:
        out.append(Problem("parallelism.dist_init_addr", "a multi-node deployment needs dist_init_addr"))
    per_node = p.nprocs_per_node or world // p.nnodes
    if p.devices is not None and len(p.devices) != per_node:
        out.append(Problem("parallelism.devices", f"{len(p.devices)} devices listed for {per_node} workers on this "
                           "node (tp x pp x dp / nnodes): list one device per worker"))
    if p.devices is not None and cfg.model.device == "cpu":
        out.append(Problem("parallelism.devices", "devices are GPU indices; model.device is cpu"))
    return out


def _speculative(cfg: ApplianceConfig) -> list[Problem]:
    s = cfg.speculative
    out: list[Problem] = []
    if s.algorithm is None:
        defaults = type(s)()
        touched = [k for k in type(s).model_fields if getattr(s, k) != getattr(defaults, k)]
        if touched:
            out.append(Problem(f"speculative.{sorted(touched)[0]}",
                               "speculative settings are given but speculative.algorithm is not set"))
        return out
    if s.algorithm in _NEEDS_DRAFT_MODEL and not s.draft_model_path:
        out.append(Problem("speculative.draft_model_path", f"algorithm {s.algorithm} needs a draft model"))
    if s.algorithm in ("MTP", "NGRAM") and s.draft_model_path:
        out.append(Problem("speculative.draft_model_path",
                           f"algorithm {s.algorithm} uses no separate draft model; remove draft_model_path"))
    if s.algorithm != "NGRAM":
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(s, key) is not None:
                out.append(Problem(f"speculative.{key}", "only meaningful with algorithm NGRAM"))
        if s.ngram_proposer != "host":
            out.append(Problem("speculative.ngram_proposer", "only meaningful with algorithm NGRAM"))
    if s.prompt_lookup_min is not None and s.prompt_lookup_max is not None \
            and s.prompt_lookup_min > s.prompt_lookup_max:
        out.append(Problem("speculative.prompt_lookup_min", "must not exceed prompt_lookup_max"))
    if s.eagle3_layers_to_capture is not None and s.algorithm != "EAGLE3":
        out.append(Problem("speculative.eagle3_layers_to_capture", "only meaningful with algorithm EAGLE3"))
    out += _synthetic_acceptance(s)
    if s.eagle_topk == 1 and s.num_draft_tokens is not None and s.num_draft_tokens > s.num_steps + 1:
        out.append(Problem("speculative.num_draft_tokens",
                           f"with eagle_topk 1 a chain has at most num_steps + 1 = {s.num_steps + 1} tokens"))
    # a tree search offers topk children of the root, then topk * topk candidates per further step
    offered = 1 + s.eagle_topk + (s.num_steps - 1) * s.eagle_topk * s.eagle_topk
    if s.eagle_topk > 1 and s.num_draft_tokens is not None and not 2 <= s.num_draft_tokens <= offered:
        out.append(Problem("speculative.num_draft_tokens",
                           f"a tree of eagle_topk {s.eagle_topk} over num_steps {s.num_steps} has 2 to 1 + topk + "
                           f"(num_steps - 1) * topk^2 = {offered} tokens (the root and its nodes)"))
    return out


def _synthetic_acceptance(s: Any) -> list[Problem]:
    """The forced accept decision is for benchmarks: it needs its explicit switch, and a reachable target."""
    out: list[Problem] = []
    length, rates = s.synthetic_acceptance_length, s.synthetic_acceptance_rates
    given = "synthetic_acceptance_length" if length is not None else "synthetic_acceptance_rates" if rates else None
    if given and not s.enable_synthetic_acceptance:
        out.append(Problem(f"speculative.{given}", "benchmark-only: it makes outputs differ from the model's; set "
                           "speculative.enable_synthetic_acceptance = true to use it"))
    if length is not None and rates is not None:
        out.append(Problem("speculative.synthetic_acceptance_rates", "give synthetic_acceptance_length or "
                           "synthetic_acceptance_rates, not both"))
    if length is not None and length > s.num_steps + 1:
        out.append(Problem("speculative.synthetic_acceptance_length",
                           f"{length} is more than num_steps + 1 = {s.num_steps + 1} tokens per verification"))
    if rates is not None and (len(rates) != s.num_steps or not all(0.0 <= r <= 1.0 for r in rates)):
        out.append(Problem("speculative.synthetic_acceptance_rates",
                           f"needs num_steps = {s.num_steps} probabilities in [0, 1], got {rates}"))
    return out


def _scheduler(cfg: ApplianceConfig) -> list[Problem]:
    sch, block = cfg.scheduler, cfg.cache.block_size
    out: list[Problem] = []
    if sch.chunked_prefill_size != -1 and sch.chunked_prefill_size < block:
        out.append(Problem("scheduler.chunked_prefill_size",
                           f"{sch.chunked_prefill_size} is smaller than cache.block_size {block} (or use -1)"))
    mixed = sch.max_mixed_prefill_tokens
    if mixed is not None and mixed > 0 and sch.chunked_prefill_size == -1:
        out.append(Problem("scheduler.max_mixed_prefill_tokens",
                           f"{mixed} bounds prefill chunks beside decodes: it needs chunked prefill "
                           "(scheduler.chunked_prefill_size > 0), or unset it"))
    total = cfg.cache.max_total_tokens
    if total is not None and total < block:
        out.append(Problem("cache.max_total_tokens", f"{total} is smaller than one block ({block} tokens)"))
    interval = cfg.cache.ssm_checkpoint_interval
    if interval is not None and interval % block:
        out.append(Problem("cache.ssm_checkpoint_interval", f"{interval} is not a multiple of cache.block_size "
                                                            f"{block} (state snapshots sit at block boundaries)"))
    return out


def _api(cfg: ApplianceConfig) -> list[Problem]:
    out: list[Problem] = []
    if cfg.api.api_key is not None and not cfg.api.api_key.strip():
        out.append(Problem("api.api_key", "is empty; unset it or give a token"))
    if cfg.api.thinking_budget is not None and cfg.api.reasoning_parser is None:
        out.append(Problem("api.thinking_budget", "needs api.reasoning_parser: the budget is enforced on the "
                           "reasoning block, whose tags the parser names"))
    return out


def read_model_config(cfg: ApplianceConfig) -> dict[str, Any] | None:
    """The model's config.json with hf_overrides applied, or None when it is not a readable local file."""
    path = Path(resolve_model_path(cfg.model.path)) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    text_cfg = data.get("text_config")
    if isinstance(text_cfg, dict):  # multimodal wrappers keep the LM's numbers one level down
        data = {**data, **text_cfg}
    return {**data, **cfg.model.hf_overrides}


def check_model(cfg: ApplianceConfig) -> list[Problem]:
    """Checks against the model's config.json. A configured path that does not resolve to a local config.json
    (a repo id, a path on another machine) skips them with a warning; the embedded default model is checked only
    when model.path is unset, which is how a config names it."""
    mc = read_model_config(cfg)
    if mc is None:
        if cfg.model.path is None:
            return []
        return [Problem("model.path", f"{cfg.model.path!r} is not a local model directory here (no config.json): "
                        "the checks against the model's config are skipped", "warning")]
    out: list[Problem] = []
    tp = cfg.parallelism.tp
    heads, kv_heads = mc.get("num_attention_heads"), mc.get("num_key_value_heads")
    if isinstance(heads, int) and heads % tp:
        out.append(Problem("parallelism.tp", f"the model's {heads} attention heads are not divisible by tp {tp}"))
    if isinstance(kv_heads, int) and kv_heads % tp and tp % kv_heads:
        out.append(Problem("parallelism.tp",
                           f"tp {tp} and the model's {kv_heads} KV heads: one must divide the other"))
    limit, want = mc.get("max_position_embeddings"), cfg.model.max_model_len
    if isinstance(limit, int) and want is not None and want > limit:
        out.append(Problem("model.max_model_len",
                           f"{want} exceeds the model's max_position_embeddings {limit}; set "
                           "model.hf_overrides.max_position_embeddings to override"))
    experts = mc.get("n_routed_experts", mc.get("num_experts", mc.get("num_local_experts")))
    ep = cfg.parallelism.effective_ep
    if isinstance(experts, int) and ep > 1 and experts % ep:
        out.append(Problem("parallelism.ep", f"the model's {experts} experts are not divisible by ep {ep}"))
    if cfg.parallelism.enable_expert_parallel and mc and experts is None:
        out.append(Problem("parallelism.enable_expert_parallel", "the model has no MoE experts", "warning"))
    out += _speculative_model(cfg, mc)
    out += _mxfp4_experts(cfg, mc)
    return out


def _mxfp4_experts(cfg: ApplianceConfig, mc: dict[str, Any]) -> list[Problem]:
    """precision.moe_weight_format = mxfp4 keeps experts that ship in MXFP4: gpt-oss's (models/gpt_oss.py refuses
    the others at start-up)."""
    if cfg.precision.moe_weight_format != "mxfp4" or mc.get("model_type") == "gpt_oss":
        return []
    return [Problem("precision.moe_weight_format", "mxfp4 keeps the experts of models that ship them in MXFP4 "
                    f"(gpt-oss); this model ({mc.get('model_type')}) has none: the workers refuse to start",
                    "warning")]


def _speculative_model(cfg: ApplianceConfig, mc: dict[str, Any]) -> list[Problem]:
    """MTP drafts with the model's own multi-token-prediction layers: DeepSeek-V3-family configs declare them."""
    if cfg.speculative.algorithm != "MTP":
        return []
    n = mc.get("num_nextn_predict_layers", mc.get("num_mtp_layers"))
    if not isinstance(n, int) or n < 1:
        # a warning: `appliance validate` shows it, and the workers refuse to start with this model
        return [Problem("speculative.algorithm", "MTP needs the model's multi-token-prediction layers; its "
                        "config.json declares none (num_nextn_predict_layers)", "warning")]
    return []
