"""Rules that need more than one flag: they run after every flag use has been applied.

Kept to what no single table row can say: host + port pairs, vLLM's per-node data-parallel layout, chunked
prefill switched off, an EP size that implies expert parallelism, the visible devices, engine defaults.
"""
from __future__ import annotations

import json
import re
from typing import Any

from appliance.config.flags import vllm_spec_method
from appliance.translate import schema_view
from appliance.translate.apply import Applier
from appliance.translate.argv import FlagUse
from appliance.translate.result import Pending, Translation
from appliance.translate.shell import restore
from appliance.translate.spec import EngineTable


def finish(out: Translation, applier: Applier, uses: list[FlagUse], table: EngineTable,
           env: dict[str, str], devices: list[str] | None) -> None:
    scratch = applier.scratch
    _chunked_prefill(out, scratch)
    _dist_addr(out, scratch, table)
    _dp_attention(out, scratch)
    _dp_layout(out, scratch)
    _world(out)
    _expert_parallel(out)
    _deepep_mode(out, uses)
    _draft_only(out)
    _method_implies(out, uses)
    _eagle_as_mtp(out)
    _mtp(out)
    _host_tier(out)
    _devices(out, env, devices)
    _engine_defaults(out, table)


def _chunked_prefill(out: Translation, scratch: dict[str, tuple[Any, str]]) -> None:
    if "@chunked_prefill" not in scratch:
        return
    on, source = scratch["@chunked_prefill"]
    if on is True:
        out.implied(source, "chunked prefill is on by default here")
        return
    budget = out.settings.get("scheduler.chunked_prefill_size")
    if budget is not None:
        out.set("scheduler.max_prefill_tokens", budget.value, budget.source,
                "with chunked prefill off, vLLM's --max-num-batched-tokens bounds whole-prompt prefills")
    out.set("scheduler.chunked_prefill_size", -1, source, "-1 turns chunked prefill off")


# the rendezvous port an engine uses when the command names only the host
DEFAULT_MASTER_PORT = {"vllm": (29501, "vLLM's default --master-port")}


def _dist_addr(out: Translation, scratch: dict[str, tuple[Any, str]], table: EngineTable) -> None:
    host, port = scratch.get("@dist_host"), scratch.get("@dist_port")
    if host is None and port is None:
        return
    if host is not None and port is None and table.name in DEFAULT_MASTER_PORT:
        value, why = DEFAULT_MASTER_PORT[table.name]
        port = (value, f"({why})")
    if host is None or port is None:
        if any(p.path == "parallelism.dist_init_addr" for p in out.pending):
            return  # the other half is unresolved: already reported
        given = host or port
        assert given is not None
        missing = "port" if port is None else "host"
        addr = f"{host[0] if host else '?'}:{port[0] if port else '?'}"
        out.pending.append(Pending("parallelism.dist_init_addr", addr, given[1], f"no {missing} given"))
        out.warn(given[1], f"parallelism.dist_init_addr needs host:port and the {missing} is not given; "
                 "left commented out")
        return
    out.set("parallelism.dist_init_addr", f"{host[0]}:{port[0]}", f"{host[1]} {port[1]}",
            "host and port of the rank-0 node, one setting here")


def _int(scratch: dict[str, tuple[Any, str]], key: str, out: Translation) -> int | None:
    if key not in scratch:
        return None
    try:
        return int(scratch[key][0])
    except (TypeError, ValueError):
        out.warn(scratch[key][1], "not an integer; ignored", unmapped=True)
        return None


def _dp_layout(out: Translation, scratch: dict[str, tuple[Any, str]]) -> None:
    local, start = _int(scratch, "@dp_local", out), _int(scratch, "@dp_start_rank", out)
    if local is None:
        if start is not None:
            out.warn(scratch["@dp_start_rank"][1], "needs --data-parallel-size-local to find the node rank",
                     unmapped=True)
        return
    src = scratch["@dp_local"][1]
    tp, dp = out.get("parallelism.tp", 1), out.get("parallelism.dp", 1)
    if not isinstance(tp, int) or not isinstance(dp, int) or local < 1:
        return
    out.set("parallelism.nprocs_per_node", local * tp, src, f"{local} DP replicas x tp {tp} on this node")
    if dp % local == 0:
        out.set("parallelism.nnodes", dp // local, src, f"dp {dp} / {local} replicas per node")
    if start is not None:
        out.set("parallelism.node_rank", start // local, scratch["@dp_start_rank"][1],
                f"first DP rank {start} / {local} replicas per node")


def _dp_attention(out: Translation, scratch: dict[str, tuple[Any, str]]) -> None:
    """SGLang's `--tp T --dp D --enable-dp-attention`: T ranks in all, attention in D replicas of T/D."""
    if scratch.get("@dp_attention", (False, ""))[0] is not True:
        return
    source = scratch["@dp_attention"][1]
    tp, dp = out.get("parallelism.tp", 1), out.get("parallelism.dp", 1)
    if not isinstance(tp, int) or not isinstance(dp, int) or dp < 2 or tp % dp:
        out.note(source, f"tp {tp} and dp {dp}: no attention replicas to split (dp must divide tp); nothing set")
        return
    note = f"attention tp {tp // dp} x dp {dp} = {tp} ranks; dense layers tensor-parallel over all {tp}"
    source = " ".join(s.source for k in ("parallelism.tp", "parallelism.dp")
                      if (s := out.settings.get(k)) is not None) + " " + source
    out.set("parallelism.tp", tp // dp, source, note)
    if "parallelism.dense_tp" not in out.settings:
        out.set("parallelism.dense_tp", tp, source, note)
    expert_parallel = out.get("parallelism.enable_expert_parallel", False) or out.get("parallelism.ep", 1) != 1
    if "parallelism.moe_tp" not in out.settings and not expert_parallel:
        out.set("parallelism.moe_tp", tp, source, "MoE layers tensor-parallel over all ranks too")


def _world(out: Translation) -> None:
    """An explicit world size with one of tp / dp left out (TokenSpeed's split form): the other follows."""
    world = out.settings.get("parallelism.world_size")
    if world is None or not isinstance(world.value, int):
        return
    tp, dp, pp = (out.get(f"parallelism.{k}", 1) for k in ("tp", "dp", "pp"))
    if not all(isinstance(v, int) and v > 0 for v in (tp, dp, pp)) or world.value == tp * dp * pp:
        return
    if "parallelism.tp" not in out.settings and world.value % (dp * pp) == 0:
        out.set("parallelism.tp", world.value // (dp * pp), world.source,
                "no attention TP size given: it spans the world (world_size / dp / pp)")
    elif "parallelism.dp" not in out.settings and world.value % (tp * pp) == 0:
        out.set("parallelism.dp", world.value // (tp * pp), world.source,
                "attention replicas: world_size / attention tp / pp (TokenSpeed's data-parallel attention)")


def _expert_parallel(out: Translation) -> None:
    ep = out.settings.get("parallelism.ep")
    if ep is not None and isinstance(ep.value, int) and ep.value > 1 and \
            "parallelism.enable_expert_parallel" not in out.settings:
        out.set("parallelism.enable_expert_parallel", True, ep.source, "an EP size above 1 means expert parallelism")


def _deepep_mode(out: Translation, uses: list[FlagUse]) -> None:
    for use in uses:
        if use.flag is not None and use.flag.canonical == "--all2all-backend" and isinstance(use.value, str):
            mode = {"deepep_low_latency": "low_latency", "deepep_high_throughput": "normal"}.get(use.value.lower())
            if mode and "backends.deepep_mode" not in out.settings:
                out.set("backends.deepep_mode", mode, use.display, "the DeepEP mode vLLM's backend name carries")


# architectures with their own multi-token-prediction (NextN) layers, by the names their checkpoints carry
MTP_ARCHITECTURES = re.compile(r"deepseek-(v3|r1|v4)|mimo|glm-?4\.[5-9]|glm-?5|qwen3-next|qwen3\.[5-9]|step-?3\.5"
                               r"|ernie-?4\.5|longcat", re.I)


def _draft_only(out: Translation) -> None:
    """vLLM's speculative config without a method: the draft model's name decides (as vLLM does)."""
    draft = out.settings.get("speculative.draft_model_path")
    if draft is None or "speculative.algorithm" in out.settings:
        return
    name = str(draft.value).lower()
    algorithm = "EAGLE3" if "eagle3" in name else "EAGLE" if "eagle" in name else "STANDALONE"
    out.set("speculative.algorithm", algorithm, draft.source, "no method given: vLLM infers it from the draft "
            f"model's name ({algorithm}: {'an EAGLE head' if 'EAGLE' in algorithm else 'a smaller LLM drafts'})")


def _method_implies(out: Translation, uses: list[FlagUse]) -> None:
    """What a vLLM method name says beyond the algorithm (ngram_gpu: NGRAM with the lookup on the device)."""
    for use in uses:
        if use.flag is None or use.flag.canonical != "--speculative-config" or not isinstance(use.value, str):
            continue
        method = use.value if use.subkey == "method" else _json_key(use.value, "method")
        implied = vllm_spec_method(method)[1] if isinstance(method, str) else {}
        for key, value in implied.items():
            out.set(f"speculative.{key}", value, use.display, f"vLLM's method {method.strip()} says {key} {value}")


def _json_key(text: str, key: str) -> Any:
    try:
        doc = json.loads(restore(text))
    except ValueError:
        return None
    return doc.get(key) if isinstance(doc, dict) else None


def _eagle_as_mtp(out: Translation) -> None:
    """SGLang's EAGLE without a draft model runs the target's own MTP (NextN) layers as the drafter."""
    algo = out.settings.get("speculative.algorithm")
    if algo is None or algo.value != "EAGLE" or "speculative.draft_model_path" in out.settings \
            or any(p.path == "speculative.draft_model_path" for p in out.pending):
        return
    model = str(out.get("model.path", ""))
    known = MTP_ARCHITECTURES.search(model)
    why = f"{model} has its own MTP layers" if known else \
        "no draft model is given, so the engine drafts with the model's own MTP (NextN) layers"
    out.set("speculative.algorithm", "MTP", algo.source, f"EAGLE without a draft model is SGLang's way to run the "
            f"model's multi-token-prediction layers: algorithm MTP ({why})")


def _host_tier(out: Translation) -> None:
    """A host-tier size or policy (TokenSpeed's KVStore is on unless --disable-kvstore) turns the tier on."""
    tier = [s for k, s in out.settings.items() if k.startswith("cache.host_cache_")]
    if tier and "cache.host_cache" not in out.settings:
        out.set("cache.host_cache", True, tier[0].source, "a host-tier setting turns the host tier on")


def _mtp(out: Translation) -> None:
    if out.get("speculative.algorithm") in ("MTP", "NGRAM") and "speculative.draft_model_path" in out.settings:
        dropped = out.settings.pop("speculative.draft_model_path")
        algorithm = out.get("speculative.algorithm")
        if dropped.value == out.get("model.path"):  # the target's own checkpoint holds its MTP layers
            out.implied(dropped.source, f"{algorithm} drafts with the model's own layers: nothing to set")
        else:
            out.note(dropped.source, f"{algorithm} uses no separate draft model; the model {dropped.value!r} is "
                     "not needed here")


def _devices(out: Translation, env: dict[str, str], devices: list[str] | None) -> None:
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.startswith("$"):
        devices = [d for d in visible.split(",") if d.strip()]
        origin = f"CUDA_VISIBLE_DEVICES={visible}"
    elif devices is not None:
        origin = "docker --gpus"
    else:
        return
    out.context.append(f"devices {devices} (from {origin})")
    tp, dp = out.get("parallelism.tp", 1), out.get("parallelism.dp", 1)
    per_node = out.get("parallelism.nprocs_per_node")
    want = per_node if isinstance(per_node, int) else (tp * dp if isinstance(tp, int) and isinstance(dp, int)
                                                       else None)
    nnodes = out.get("parallelism.nnodes", 1)
    if want is not None and isinstance(nnodes, int) and nnodes == 1 and want != len(devices):
        out.warn(origin, f"{len(devices)} devices are visible but the deployment uses {want} (tp x dp)")
    indices = [d.strip() for d in devices]
    # docker --gpus names host devices that the container sees renumbered from 0: only the variable maps
    if (visible is not None and want is not None and all(d.isdigit() for d in indices)
            and len(set(indices)) == len(indices) and len(indices) >= want):
        # the first `want` visible devices are the ones the engine's workers used
        out.set("parallelism.devices", [int(d) for d in indices[:want]], origin,
                "one device per worker, as each worker's CUDA_VISIBLE_DEVICES")
    else:
        out.context.append(f"devices {devices} are not mapped (docker --gpus, device UUIDs or an unknown worker count): "
                           f"keep CUDA_VISIBLE_DEVICES={','.join(devices)} in the environment that starts the "
                           "appliance (or set parallelism.devices)")


def _engine_defaults(out: Translation, table: EngineTable) -> None:
    for path, value, why in table.defaults:
        if path in out.settings or any(p.path == path for p in out.pending):
            continue
        info = schema_view.key_info(path)
        if info is not None and info.default != value:
            out.set(path, value, "(default)", f"{why}; kept so the deployment behaves as before")
