#!/usr/bin/env python3
"""The cuBLASLt algorithms for the decode GEMMs, timed against F.linear (cuBLAS's own pick): fills
appliance/kernels/cublaslt.py's TUNED table.

    python3 tools/lab_cublaslt.py [--rows 128,216,256] [--shapes llama] [--emit] [--min-gain 1.03]

For each weight shape (N, K) and row count M (default: the decode capture sizes past the GEMV, 24..256 step 8),
bf16, y = x W^T:
- the pool: the heuristic's workspace-free candidates for M and for other row counts, each also with every
  thread-block cluster shape seen among them, deduplicated, kept where cublasLtMatmulAlgoCheck accepts them;
- each candidate checked against F.linear on random inputs (max error within bf16 rounding of the output), then
  timed like tools/lab_blas.py: a CUDA graph over enough weight copies to exceed L2, median of 5 replays;
- the fastest timed again beside F.linear, alternating, 3 rounds (best of each): the confirmed speedup.
Prints one JSON line per shape and row count; with --emit, then the TUNED literal of the winners whose confirmed
speedup is at least --min-gain. Qwen3's shapes skip the row counts the Triton skinny GEMM already takes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))
from gpu_measure import graph_call_us

from appliance.kernels import cublaslt as lt_mod
from appliance.kernels.cublaslt import Algo, Lt, LtAlgo, Problem

SHAPES = {  # name -> (N, K) of y = x W^T
    "llama.qkv": (6144, 4096), "llama.o": (4096, 4096), "llama.gate_up": (28672, 4096), "llama.down": (4096, 14336),
    "qwen.qkv": (4096, 1024), "qwen.o": (1024, 2048), "qwen.gate_up": (6144, 1024), "qwen.down": (1024, 3072),
    "llama.lm_head": (128256, 4096), "qwen.lm_head": (151936, 1024),
}
OTHER_ROWS = (32, 64, 128, 160, 192, 224, 256, 384, 512, 1024)  # whose heuristic picks join every pool


def pool(lt: Lt, m: int, n: int, k: int, count: int) -> list[tuple[LtAlgo, Algo]]:
    """Workspace-free algorithms the library accepts for [m, k] x [n, k]^T, deduplicated by configuration."""
    found = [h.algo for r in (m, *OTHER_ROWS) for h in lt.candidates(Problem(lt, r, n, k), count)]
    specs = {lt.describe(a) for a in found}
    clusters = {s.cluster for s in specs}
    specs |= {LtAlgo(**{**s.__dict__, "cluster": c}) for s in specs for c in clusters}
    p, kept = Problem(lt, m, n, k), []
    for spec in sorted(specs, key=lambda s: tuple(s.__dict__.values())):
        try:
            algo = lt.build(spec)
        except lt_mod.LtError:
            continue
        if lt.workspace(p, algo) == 0:
            kept.append((spec, algo))
    return kept


def sweep(lt: Lt, torch: Any, name: str, m: int, n: int, k: int, count: int) -> dict[str, Any]:
    import torch.nn.functional as F

    copies = max(2, -(-200 * 2**20 // (n * k * 2)))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, ws[0]).float()
    tol = 1e-2 * ref.abs().max().item()  # bf16 output rounding is 2^-8 relative
    p = Problem(lt, m, n, k)
    rows, wrong = [], 0
    for spec, algo in pool(lt, m, n, k, count):
        lt.matmul(p, algo, x, ws[0], y)
        if not (y.float() - ref).abs().max().item() <= tol:
            wrong += 1
            continue
        rows.append((graph_call_us(lambda i, a=algo: lt.matmul(p, a, x, ws[i], y), copies), spec, algo))
    out: dict[str, Any] = {"shape": name, "rows": m, "candidates": len(rows), "wrong": wrong}
    if not rows:
        return out
    rows.sort(key=lambda r: r[0])
    us, spec, algo = rows[0]
    again: dict[str, list[float]] = {"torch": [], "lt": []}
    for _ in range(3):  # a sweep's winner is biased low: time it again beside torch, alternating
        again["torch"].append(graph_call_us(lambda i: F.linear(x, ws[i]), copies))
        again["lt"].append(graph_call_us(lambda i: lt.matmul(p, algo, x, ws[i], y), copies))
    t, b = min(again["torch"]), min(again["lt"])
    return {**out, "torch_us": t, "lt_us": b, "speedup": round(t / b, 3), "sweep_us": us, "best": spec.__dict__,
            "next_us": [r[0] for r in rows[1:6]]}


def emit(results: list[dict[str, Any]], min_gain: float) -> None:
    table: dict[tuple[int, int], list[str]] = {}
    for r in results:
        if r.get("speedup", 0) >= min_gain:
            fields = ", ".join(f"{k}={v}" for k, v in r["best"].items() if v != LtAlgo.__dataclass_fields__[k].default
                               or k in ("tile", "stages", "cluster"))
            table.setdefault(SHAPES[r["shape"]], []).append(f"{r['rows']}: LtAlgo({fields}),  # {r['speedup']}x")
    print("TUNED = {")
    for shape, entries in table.items():
        print(f"    {shape}: {{")
        for e in entries:
            print(f"        {e}")
        print("    },")
    print("}")


def qwen_rows_left(n: int, k: int, rows: list[int]) -> list[int]:
    """Row counts the Triton skinny GEMM does not take for this shape (its TUNED says cuBLAS)."""
    from appliance.kernels.triton.skinny_gemm import tuned_config

    return [m for m in rows if tuned_config(m, n, k) is None]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(str(r) for r in range(24, 257, 8)))
    ap.add_argument("--shapes", default="llama,qwen", help="name prefixes of SHAPES")
    ap.add_argument("--algos", type=int, default=32, help="candidates asked of the heuristic per row count")
    ap.add_argument("--emit", action="store_true", help="print the TUNED literal at the end")
    ap.add_argument("--min-gain", type=float, default=1.03)
    args = ap.parse_args()
    import torch

    lt = lt_mod.handle(torch.device("cuda", torch.cuda.current_device()))
    prefixes = tuple(args.shapes.split(","))
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name, (n, k) in SHAPES.items():
        if not name.startswith(prefixes):
            continue
        for m in qwen_rows_left(n, k, rows) if name.startswith("qwen") else rows:
            results.append(sweep(lt, torch, name, m, n, k, args.algos))
            print(json.dumps(results[-1]), flush=True)
    if args.emit:
        emit(results, args.min_gain)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
