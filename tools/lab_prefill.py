#!/usr/bin/env python3
"""The Triton prefill attention's tile configs (kernels/triton/prefill.py BLOCK_M, BLOCK_N, NUM_WARPS,
NUM_STAGES) on the prefill chunks of the throughput runs: which is fastest, and is each one right.

    python3 tools/lab_prefill.py [--configs 64:64:4:2,128:64:8:3] [--smoke]

Cases: Llama-3.1-8B heads (32 q / 8 kv, head_dim 128) and Qwen3-0.6B heads (16 / 8 / 128), a chunk of 8 fresh
1,024-token prompts, and a chunk of Qwen3-workload prompts (100-1,024 tokens, 8,192 in all), page 16, bf16. Each
config's output is checked against the registered config's (and that one against the torch reference on the
first case); time is the median of 20 calls with CUDA events. Prints one JSON line per case and config:
us, TFLOP/s (causal: half the QK^T and PV products), max error.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from gpu_measure import replay_ms

DEFAULT_CONFIGS = ("64:64:4:2,128:64:8:3,128:64:4:3,128:32:4:3,64:64:4:3,128:128:8:2,64:128:4:2,128:64:8:2,"
                   "64:32:4:3")


def case(torch: Any, heads: tuple[int, int], lens: list[int], dev: str, page: int = 16) -> dict[str, Any]:
    """q for fresh prompts of `lens` tokens and a paged cache holding them (blocks shuffled)."""
    h, hkv = heads
    d, t = 128, sum(lens)
    blocks = [-(-n // page) for n in lens]
    perm = torch.randperm(sum(blocks), device=dev)
    width = max(blocks)
    bt = torch.zeros(len(lens), width, dtype=torch.int32, device=dev)
    at = 0
    for i, nb in enumerate(blocks):
        bt[i, :nb] = perm[at:at + nb]
        at += nb
    k = torch.randn(sum(blocks), page, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=dev)
    flops = sum(4 * n * (n + 1) / 2 * d * h for n in lens)
    return {"q": torch.randn(t, h, d, device=dev, dtype=torch.bfloat16), "k": k, "v": v, "cu": cu,
            "lens": torch.tensor(lens, dtype=torch.int32, device=dev), "bt": bt, "flops": flops}


def run(prefill: Any, c: dict[str, Any]) -> Any:
    return prefill.prefill_attention(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["bt"], 128 ** -0.5)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help="BLOCK_M:BLOCK_N:warps:stages,...")
    ap.add_argument("--smoke", action="store_true", help="tiny lengths; on the CPU set TRITON_INTERPRET=1")
    args = ap.parse_args()
    import torch

    from appliance.kernels import registry
    from appliance.kernels.triton import prefill

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    rng = random.Random(0)
    qwen_lens: list[int] = []
    while sum(qwen_lens) < 8192 - 1024:
        qwen_lens.append(rng.randint(100, 1024))
    qwen_lens.append(8192 - sum(qwen_lens))
    cases = {"llama-8x1024": ((32, 8), [1024] * 8), "qwen-8x1024": ((16, 8), [1024] * 8),
             "qwen-ragged": ((16, 8), qwen_lens)}
    if args.smoke:
        cases = {"smoke": ((4, 2), [20, 37])}
    registered = (prefill.BLOCK_M, prefill.BLOCK_N, prefill.NUM_WARPS, prefill.NUM_STAGES)
    configs = [tuple(int(x) for x in c.split(":")) for c in args.configs.split(",")]
    for name, (heads, lens) in cases.items():
        c = case(torch, heads, lens, dev)
        base = run(prefill, c).float()
        if name == next(iter(cases)):
            ref = registry.get("prefill_attention", "torch")(c["q"], c["k"], c["v"], c["cu"], c["lens"], c["bt"],
                                                            128 ** -0.5).float()
            print(json.dumps({"case": name, "registered_vs_reference": (base - ref).abs().max().item()}), flush=True)
        for cfg in configs:
            prefill.BLOCK_M, prefill.BLOCK_N, prefill.NUM_WARPS, prefill.NUM_STAGES = cfg
            row: dict[str, Any] = {"case": name, "config": ":".join(map(str, cfg))}
            try:
                err = (run(prefill, c).float() - base).abs().max().item()
                us = replay_ms(lambda c=c: run(prefill, c), 3 if args.smoke else 20) * 1e3 if dev == "cuda" else 0.0
                row.update(us=round(us, 1), tflops=round(c["flops"] / us / 1e6, 1) if us else None, err=err)
            except Exception as e:  # noqa: BLE001 (a config that does not compile or fit: a row, not a crash)
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            print(json.dumps(row), flush=True)
        prefill.BLOCK_M, prefill.BLOCK_N, prefill.NUM_WARPS, prefill.NUM_STAGES = registered
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
