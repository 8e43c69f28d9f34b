"""The peer's KV memory per sequence, from its own KV cache configuration (benchmarks/peer_measure.py).

`kv_facts` runs inside vLLM's worker (LLM.collective_rpc) and returns plain numbers: the groups of its KV cache
(kind, layers, block size, bytes of one layer's block, and the bytes its spec reserves for one request of
max_model_len), the pool's bytes and blocks, and the concurrency vLLM's own start-up log reports. `kv_per_sequence`
turns them into benchmarks/models.py's keys: `allocated_gib` is the pool's bytes over that concurrency (what one
request of max_model_len holds by vLLM's admission: its sliding-window groups reserve the window plus a step's
tokens), `window_share_gib` the groups' blocks, both against every attention layer keeping the whole context.
"""
from __future__ import annotations

from typing import Any

GIB = 2**30


def kv_facts(worker: Any) -> dict[str, Any]:
    """In vLLM's worker process: its KV cache configuration as plain numbers."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    config = worker.model_runner.kv_cache_config
    vllm_config = worker.vllm_config
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append({"spec": type(spec).__name__, "layers": len(group.layer_names),
                       "block_size": spec.block_size, "page_bytes": spec.page_size_bytes,
                       "sliding_window": getattr(spec, "sliding_window", None),
                       "request_bytes": spec.max_memory_usage_bytes(vllm_config)})
    layers = vllm_config.compilation_config.static_forward_context.values()
    backends = sorted({layer.attn_backend.get_name() for layer in layers if hasattr(layer, "attn_backend")})
    return {"num_blocks": config.num_blocks, "kv_bytes": sum(t.size for t in config.kv_cache_tensors),
            "max_model_len": vllm_config.model_config.max_model_len, "groups": groups,
            "max_concurrency": get_max_concurrency_for_kv_cache_config(vllm_config, config),
            "attention_backends": backends}


def group_name(group: dict[str, Any]) -> str:
    """Ours' names: "full", "window_W"; a recurrent-state group by its spec ("mamba")."""
    if group["sliding_window"] is not None:
        return f"window_{group['sliding_window']}"
    return "mamba" if "Mamba" in group["spec"] else "full"


def kv_per_sequence(facts: dict[str, Any]) -> dict[str, Any]:
    """benchmarks/models.py's kv_per_sequence keys for one request of max_model_len tokens."""
    context = facts["max_model_len"]
    attention = [g for g in facts["groups"] if group_name(g) != "mamba"]
    held: dict[str, dict[str, int]] = {}
    for g in attention:  # vLLM splits layers of one kind into groups of equal size: ours count them as one
        entry = held.setdefault(group_name(g), {"layers": 0, "blocks": -(-g["request_bytes"] // g["page_bytes"])})
        entry["layers"] += g["layers"]
    every_layer = sum(g["layers"] * -(-context // g["block_size"]) * g["page_bytes"] for g in attention)
    windowed = sum(g["layers"] * g["request_bytes"] for g in attention)
    allocated = facts["kv_bytes"] / facts["max_concurrency"] if facts["max_concurrency"] else float("nan")
    return {"context": context, "block_size": attention[0]["block_size"] if attention else None,
            "kv_groups": len(facts["groups"]) > 1,
            "blocks_per_sequence": {name: h["blocks"] for name, h in held.items()}, "group_blocks": held,
            "allocated_gib": allocated / GIB, "window_share_gib": windowed / GIB,
            "ratio": windowed / every_layer if every_layer else None,
            "allocated_ratio": allocated / every_layer if every_layer else None,
            "sliding_layers": sum(g["layers"] for g in attention if g["sliding_window"] is not None),
            "layers": sum(g["layers"] for g in attention),
            "max_concurrency": facts["max_concurrency"], "num_blocks": facts["num_blocks"]}
