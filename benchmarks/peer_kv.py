"""The peer's KV memory per sequence, from its own KV cache configuration (benchmarks/peer_measure.py).

`kv_facts` runs inside vLLM's worker (LLM.collective_rpc) and returns plain numbers: the groups of its KV cache
(kind, layers, block size, bytes of one layer's block, and the bytes its spec reserves for one request of
max_model_len), the pool's bytes and blocks, and the concurrency vLLM's own start-up log reports. `kv_pools` is
benchmarks/models.py's key of the same name: the one pool every group draws from and how many sequences of the
workload's length it holds (each group holding what ours holds: the context's blocks, a sliding group at most its
window's). `kv_per_sequence`
turns them into benchmarks/models.py's keys at a context: `allocated_gib` (= `window_share_gib`: what vLLM
allocates is what its groups reserve) sums each group's reservation, the context's blocks on a full-attention
group and on a sliding-window group the window plus a step's tokens (vLLM's admission), against every attention
layer keeping the whole context; `max_len_request_gib` is the pool over that concurrency, the same measure at
max_model_len from vLLM's own accounting (its pool pads groups to one size).
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


def kv_per_sequence(facts: dict[str, Any], context: int) -> dict[str, Any]:
    """benchmarks/models.py's kv_per_sequence keys for one sequence of `context` tokens: per group, the blocks its
    spec reserves for a request (at most the context's), against every attention layer keeping the whole context."""
    attention = [g for g in facts["groups"] if group_name(g) != "mamba"]
    held: dict[str, dict[str, int]] = {}
    for g in attention:  # vLLM splits layers of one kind into groups of equal size: ours count them as one
        blocks = min(-(-g["request_bytes"] // g["page_bytes"]), -(-context // g["block_size"]))
        held.setdefault(group_name(g), {"layers": 0, "blocks": blocks})["layers"] += g["layers"]
    every_layer = sum(g["layers"] * -(-context // g["block_size"]) * g["page_bytes"] for g in attention)
    reserved = sum(g["layers"] * min(-(-g["request_bytes"] // g["page_bytes"]), -(-context // g["block_size"]))
                   * g["page_bytes"] for g in attention)
    ratio = reserved / every_layer if every_layer else None
    max_len_request = facts["kv_bytes"] / facts["max_concurrency"] if facts["max_concurrency"] else None
    return {"context": context, "block_size": attention[0]["block_size"] if attention else None,
            "kv_groups": len(facts["groups"]) > 1,
            "blocks_per_sequence": {name: h["blocks"] for name, h in held.items()}, "group_blocks": held,
            "allocated_gib": reserved / GIB, "window_share_gib": reserved / GIB, "ratio": ratio,
            "allocated_ratio": ratio,
            "sliding_layers": sum(g["layers"] for g in attention if g["sliding_window"] is not None),
            "layers": sum(g["layers"] for g in attention),
            "max_model_len": facts["max_model_len"], "max_concurrency": facts["max_concurrency"],
            "pool_gib": facts["kv_bytes"] / GIB,
            "max_len_request_gib": None if max_len_request is None else max_len_request / GIB}


def kv_pools(facts: dict[str, Any], tokens: int) -> dict[str, Any]:
    """benchmarks/models.py's kv_pools keys: vLLM's one pool (its groups draw from it) and how many sequences of
    `tokens` tokens it holds, each group holding the blocks ours' groups hold at that length."""
    attention = [g for g in facts["groups"] if group_name(g) != "mamba"]

    def held(g: dict[str, Any]) -> int:
        blocks = -(-tokens // g["block_size"])
        w = g["sliding_window"]
        return blocks if w is None else min(blocks, -(-(w + g["block_size"] - 1) // g["block_size"]))

    per_seq = sum(held(g) for g in attention)
    sequences = facts["num_blocks"] // per_seq if per_seq else 0
    return {"tokens": tokens, "sequences": sequences,
            "pools": {"shared": {"blocks": facts["num_blocks"], "groups": len(attention), "sequences": sequences}}}
