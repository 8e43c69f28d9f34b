"""The cuBLASLt algorithms for the decode GEMMs, timed against F.linear (cuBLAS's own pick): writes
appliance/kernels/tuned/<arch>_cublaslt_algos.json; with --pad, <arch>_cublaslt_padded.json (kernels/cublaslt.py
reads both).

    python -m tools.lab_cublaslt [--rows 128,216,256] [--shapes llama] [--emit] [--min-gain 1.03]
    python -m tools.lab_cublaslt ... [--workspace-mb 64] [--splitk 2,3,4]   # algorithms that need a workspace too
    python -m tools.lab_cublaslt --pad 1.3 [--pad-max 8192] --emit --min-gain 1.05

For each weight shape (N, K) and row count M (default: the decode capture sizes past the GEMV, 24..256 step 8),
bf16, y = x W^T:
- the pool: the heuristic's workspace-free candidates for M and for other row counts, each also with every
  thread-block cluster shape seen among them, deduplicated, kept where cublasLtMatmulAlgoCheck accepts them;
- each candidate checked against F.linear on random inputs (max error within bf16 rounding of the output), then
  timed in a CUDA graph over enough weight copies to exceed L2, median of 5 replays;
- the fastest timed again beside F.linear, alternating, 3 rounds (best of each): the confirmed speedup.
Prints one JSON line per shape and row count; with --emit, then writes the winners whose confirmed speedup is
at least --min-gain to the algos file. Qwen3's shapes skip the row counts the Triton skinny GEMM already takes.
--workspace-mb lets candidates use a workspace, and --splitk adds split-K variants of the fastest 8 (the op itself
passes no workspace: neither measured faster at 208-224 rows). --pad times F.linear at every piecewise
token bucket past 256 rows against padded_linear to each larger bucket within reach (the padded file: where
cuBLAS's pick at M rows is slower than its pick at a few more).
"""
from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

from appliance.kernels import cublaslt as lt_mod
from appliance.kernels import tuned
from appliance.kernels.cublaslt import Algo, Lt, LtAlgo, Problem

SHAPES = {  # name -> (N, K) of y = x W^T
    "llama.qkv": (6144, 4096), "llama.o": (4096, 4096), "llama.gate_up": (28672, 4096), "llama.down": (4096, 14336),
    "qwen.qkv": (4096, 1024), "qwen.o": (1024, 2048), "qwen.gate_up": (6144, 1024), "qwen.down": (1024, 3072),
    "llama.lm_head": (128256, 4096), "qwen.lm_head": (151936, 1024),
}
OTHER_ROWS = (32, 64, 128, 160, 192, 224, 256, 384, 512, 1024)  # whose heuristic picks join every pool


def graph_call_us(call: Any, copies: int, reps: int = 5) -> float:
    """Per-call microseconds of `call(i)` for i over `copies` (weight copies that exceed L2, so each call reads
    HBM), captured in one CUDA graph after two warm-up calls: median of `reps` replays, divided by the copies."""
    import torch

    for i in range(min(2, copies)):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            call(i)
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return round(statistics.median(times) * 1e3 / copies, 2)


def pool(lt: Lt, m: int, n: int, k: int, count: int, ws: int) -> list[tuple[LtAlgo, Algo]]:
    """Algorithms needing at most `ws` bytes of workspace that the library accepts for [m, k] x [n, k]^T,
    deduplicated by configuration."""
    found = [h.algo for r in (m, *OTHER_ROWS) for h in lt.candidates(Problem(lt, r, n, k), count, ws)]
    specs = {lt.describe(a) for a in found}
    clusters = {s.cluster for s in specs}
    specs |= {LtAlgo(**{**s.__dict__, "cluster": c}) for s in specs for c in clusters}
    return accepted(lt, Problem(lt, m, n, k), specs, ws)


def accepted(lt: Lt, p: Problem, specs: set[LtAlgo], ws: int) -> list[tuple[LtAlgo, Algo]]:
    kept = []
    for spec in sorted(specs, key=lambda s: tuple(s.__dict__.values())):
        try:
            algo = lt.build(spec)
        except lt_mod.LtError:
            continue
        need = lt.workspace(p, algo)
        if need is not None and need <= ws:
            kept.append((spec, algo))
    return kept


def split_variants(specs: list[LtAlgo], splits: list[int]) -> set[LtAlgo]:
    """Each spec with split-K factors and every reduction scheme (in place, compute type, output type)."""
    return {LtAlgo(**{**s.__dict__, "splitk": f, "reduction": r}) for s in specs for f in splits for r in (1, 2, 4)}


def sweep(lt: Lt, torch: Any, name: str, m: int, n: int, k: int, count: int, ws: int = 0,
          splits: tuple[int, ...] = ()) -> dict[str, Any]:
    import torch.nn.functional as F

    copies = max(2, -(-200 * 2**20 // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    ref = F.linear(x, weights[0]).float()
    tol = 1e-2 * ref.abs().max().item()  # bf16 output rounding is 2^-8 relative
    p = Problem(lt, m, n, k)
    buf = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda") if ws else None
    rows, wrong = [], 0

    def run(candidates: list[tuple[LtAlgo, Algo]]) -> None:
        nonlocal wrong
        for spec, algo in candidates:
            lt.matmul(p, algo, x, weights[0], y, buf)
            if not (y.float() - ref).abs().max().item() <= tol:
                wrong += 1
                continue
            rows.append((graph_call_us(lambda i, a=algo: lt.matmul(p, a, x, weights[i], y, buf), copies), spec,
                         algo))

    run(pool(lt, m, n, k, count, ws))
    if splits:  # split-K factors on the fastest few: the heuristic rarely offers them
        rows.sort(key=lambda r: r[0])
        run(accepted(lt, p, split_variants([r[1] for r in rows[:8]], list(splits)), ws))
    out: dict[str, Any] = {"shape": name, "rows": m, "candidates": len(rows), "wrong": wrong}
    if not rows:
        return out
    rows.sort(key=lambda r: r[0])
    us, spec, algo = rows[0]
    again: dict[str, list[float]] = {"torch": [], "lt": []}
    for _ in range(3):  # a sweep's winner is biased low: time it again beside torch, alternating
        again["torch"].append(graph_call_us(lambda i: F.linear(x, weights[i]), copies))
        again["lt"].append(graph_call_us(lambda i: lt.matmul(p, algo, x, weights[i], y, buf), copies))
    t, b = min(again["torch"]), min(again["lt"])
    return {**out, "torch_us": t, "lt_us": b, "speedup": round(t / b, 3), "sweep_us": us, "best": spec.__dict__,
            "workspace": lt.workspace(p, algo),
            "next_us": [r[0] for r in rows[1:6]]}


def measured_on(torch: Any) -> str:
    return f"{torch.cuda.get_device_name()}, torch {torch.__version__} + CUDA {torch.version.cuda}"


def emit(torch: Any, results: list[dict[str, Any]], min_gain: float) -> None:
    """Write the winners to kernels/tuned/<arch>_cublaslt_algos.json (read by cublaslt.tables)."""
    table: dict[str, dict[str, dict[str, Any]]] = {}
    for r in results:
        if r.get("speedup", 0) >= min_gain:
            fields = {k: v for k, v in r["best"].items() if v != LtAlgo.__dataclass_fields__[k].default
                      or k in ("tile", "stages", "cluster")}
            table.setdefault(tuned.shape_key(*SHAPES[r["shape"]]), {})[str(r["rows"])] = {
                **fields, "speedup": r["speedup"]}
    arch = tuned.arch_name(torch.cuda.get_device_capability())
    print(tuned.write("cublaslt_algos", arch, f"python -m tools.lab_cublaslt --emit --min-gain {min_gain}",
                      measured_on(torch), table))


def qwen_rows_left(n: int, k: int, rows: list[int]) -> list[int]:
    """Row counts the Triton skinny GEMM does not take for this shape (its TUNED says cuBLAS)."""
    from appliance.kernels.triton.skinny_gemm import tuned_config

    return [m for m in rows if tuned_config(m, n, k, "sm90") is None]


def pad_sweep(torch: Any, name: str, n: int, k: int, rows: list[int], reach: float) -> dict[str, Any]:
    """F.linear at each row count, and cublaslt.padded_linear (zero rows appended, the result cut back: the copy
    included) to each larger row count within `reach` x: where cuBLAS's pick at M is slower than padding to M'."""
    import torch.nn.functional as F

    copies = max(2, -(-200 * 2**20 // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
    us, pads = {}, {}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        us[m] = graph_call_us(lambda i, x=x: F.linear(x, weights[i]), copies)
        # padded_linear pads once to r: the library's own pick at r, not a table's
        padded = {r: graph_call_us(lambda i, x=x, r=r: lt_mod.padded_linear(x, weights[i], r), copies)
                  for r in rows if m < r <= m * reach}
        best = min(padded, key=padded.__getitem__, default=None)
        if best is not None and padded[best] < us[m]:
            pads[m] = {"to": best, "us": us[m], "padded_us": padded[best], "gain": round(us[m] / padded[best], 3)}
    return {"shape": name, "us": us, "pads": pads}


def emit_pads(torch: Any, results: list[dict[str, Any]], min_gain: float, reach: float) -> None:
    """Write the pads to kernels/tuned/<arch>_cublaslt_padded.json (read by cublaslt.tables)."""
    table = {}
    for r in results:
        kept = {str(m): p["to"] for m, p in r["pads"].items() if p["gain"] >= min_gain}
        if kept:
            table[tuned.shape_key(*SHAPES[r["shape"]])] = kept
    arch = tuned.arch_name(torch.cuda.get_device_capability())
    command = f"python -m tools.lab_cublaslt --pad {reach} --emit --min-gain {min_gain}"
    print(tuned.write("cublaslt_padded", arch, command, measured_on(torch), table))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(str(r) for r in range(24, 257, 8)))
    ap.add_argument("--shapes", default="llama,qwen", help="name prefixes of SHAPES")
    ap.add_argument("--algos", type=int, default=32, help="candidates asked of the heuristic per row count")
    ap.add_argument("--emit", action="store_true", help="write the winners to kernels/tuned/ at the end")
    ap.add_argument("--min-gain", type=float, default=1.03)
    ap.add_argument("--workspace-mb", type=float, default=0.0,
                    help="let candidates use this much workspace (the op itself passes none)")
    ap.add_argument("--splitk", default="", help="split-K factors tried on the fastest 8, e.g. 2,3,4")
    ap.add_argument("--pad", type=float, default=0.0, metavar="REACH",
                    help="instead: F.linear at the piecewise buckets up to --pad-max rows against padding to each "
                         "larger bucket within REACH x (e.g. 1.3); emits PADDED with --emit")
    ap.add_argument("--pad-max", type=int, default=8192)
    args = ap.parse_args()
    import torch

    prefixes = tuple(args.shapes.split(","))
    if args.pad:
        from appliance.executor.piecewise import buckets
        from appliance.kernels.reference.linear import SKINNY_GEMM_MAX_ROWS

        # past the skinny op's rows: smaller batches are decode graphs at exact sizes, which TUNED covers
        rows = [b for b in buckets(args.pad_max) if b > SKINNY_GEMM_MAX_ROWS]
        pads = [pad_sweep(torch, name, n, k, rows, args.pad) for name, (n, k) in SHAPES.items()
                if name.startswith(prefixes) and not name.endswith("lm_head")]
        for r in pads:
            print(json.dumps(r), flush=True)
        if args.emit:
            emit_pads(torch, pads, args.min_gain, args.pad)
        return 0
    lt = lt_mod.handle(torch.device("cuda", torch.cuda.current_device()))
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for name, (n, k) in SHAPES.items():
        if not name.startswith(prefixes):
            continue
        for m in qwen_rows_left(n, k, rows) if name.startswith("qwen") else rows:
            results.append(sweep(lt, torch, name, m, n, k, args.algos, int(args.workspace_mb * 2**20),
                                 tuple(int(f) for f in args.splitk.split(",") if f)))
            print(json.dumps(results[-1]), flush=True)
    if args.emit:
        emit(torch, results, args.min_gain)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
