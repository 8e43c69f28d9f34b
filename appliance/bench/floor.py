"""The weight-read floor of a decode step: the bytes of the weights one batch-1 step reads over the device's copy
bandwidth. A step cannot be faster; `appliance bench latency --weight-floor` reports TPOT against it."""
from __future__ import annotations

import statistics
import time
from typing import Any


def active_weight_bytes(model: Any) -> int:
    """Bytes of weights one batch-1 decode step reads: every parameter except an untied input embedding (one row
    is read) and, in each sparse MoE block, all but the top_k of its experts; never the MTP layers (loaded, not
    run)."""
    from appliance.layers.moe import SparseMoeBlock

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not getattr(model, "tie_word_embeddings", False):
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            experts = sum(p.numel() * p.element_size() for p in block.experts.parameters())
            num_local = block.experts.num_local
            total -= experts - experts * min(block.gate.cfg.top_k, num_local) // num_local
    mtp = getattr(model, "mtp", None)
    if mtp is not None:
        total -= sum(p.numel() * p.element_size() for p in mtp.parameters())
    return total


def copy_bandwidth(device: Any, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a device-to-device copy (read + write counted), median of 10 after 3 warm-ups."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def weight_read_floor(llm: Any, tpot_ms: float, copy_bytes: int = 1 << 30) -> dict[str, float]:
    """The floor of the LLM's model on its device, and tpot_ms over it."""
    runner = getattr(llm.executor, "runner", None)
    if runner is None:
        raise ValueError("the weight-read floor needs the model in this process (tp = dp = 1)")
    active = active_weight_bytes(runner.model)
    bandwidth = copy_bandwidth(runner.device, copy_bytes)
    floor_ms = active / bandwidth * 1e3
    return {"active_weight_GB": active / 1e9, "copy_GBps": bandwidth / 1e9, "floor_ms": floor_ms,
            "tpot_over_floor": tpot_ms / floor_ms}
