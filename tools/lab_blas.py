#!/usr/bin/env python3
"""cuBLAS against cuBLASLt (torch.backends.cuda.preferred_blas_library) on the decode GEMMs of the throughput
runs: Llama-3.1-8B's and Qwen3-0.6B's linear layers at the batch sizes their steps run, bf16, cold L2.

    python3 tools/lab_blas.py [--rows 64,128,216,256] [--smoke]

Each timing replays a CUDA graph of F.linear over enough weight copies to exceed the 50 MB L2 (as a model's
layers do), median of 5 replays, divided by the copies. Prints one JSON line per shape and row count, then
RESULT with the per-model sums (one layer's four GEMMs at each row count).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_measure import graph_call_us

SHAPES = {  # name -> (N, K) of y = x W^T
    "llama.qkv": (6144, 4096), "llama.o": (4096, 4096), "llama.gate_up": (28672, 4096), "llama.down": (4096, 14336),
    "qwen.qkv": (4096, 1024), "qwen.o": (1024, 2048), "qwen.gate_up": (6144, 1024), "qwen.down": (1024, 3072),
}


def time_linear(m: int, n: int, k: int, backend: str, smoke: bool) -> float:
    import torch
    import torch.nn.functional as F

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if smoke:
        m, n, k = min(m, 8), min(n, 64), min(k, 64)
    copies = 1 if smoke else max(2, -(-200 * 2**20 // (n * k * 2)))
    ws = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
    if dev == "cpu":
        return 0.0
    torch.backends.cuda.preferred_blas_library(backend)
    return graph_call_us(lambda i: F.linear(x, ws[i]), copies)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="64,128,216,256")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    sums: dict[str, float] = {}
    for name, (n, k) in SHAPES.items():
        for m in rows:
            got = {b: time_linear(m, n, k, b, args.smoke) for b in ("cublas", "cublaslt")}
            print(json.dumps({"shape": name, "rows": m, **{f"{b}_us": v for b, v in got.items()}}), flush=True)
            for b, v in got.items():
                key = f"{name.split('.')[0]}.m{m}.{b}"
                sums[key] = round(sums.get(key, 0.0) + v, 2)
    print("RESULT", json.dumps(sums), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
