#!/usr/bin/env python3
"""The Qwen3-0.6B throughput workload run several times in one process: the spread between runs, and what a run
pays that the next one does not (Triton compiles, logged with their time; cudaMalloc calls).

    python3 tools/bench_runs.py [--runs 5] [--layers 28]

--layers shrinks the model (the same workload, less GPU work per step, the same host work): at 2 layers the
elapsed time is the host's floor for this workload. --step-times also times every engine step: the workload
plans the same steps in every run, so the steps where run 0 is slower than the median of the later runs show
where a first run's extra time goes. Prints one JSON line per run, then RESULT with the median.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_offline import PRESETS
from bench_overlap import gen, llm_for
from gpu_measure import QWEN_SMOKE_SHAPE, qwen_requests


def log_compiles() -> list[tuple[str, float]]:
    """Wrap Triton's JIT compile step: every compile appends (kernel name, seconds)."""
    from triton.runtime.jit import JITFunction

    log: list[tuple[str, float]] = []
    orig = JITFunction._do_compile

    def timed(self: Any, *args: Any) -> Any:
        t = time.perf_counter()
        kernel = orig(self, *args)
        log.append((self.fn.__name__, round(time.perf_counter() - t, 3)))
        return kernel

    JITFunction._do_compile = timed
    return log


def cuda_mallocs() -> int:
    """cudaMalloc calls of torch's caching allocator so far (0 without a GPU)."""
    import torch

    return torch.cuda.memory_stats().get("num_device_alloc", 0) if torch.cuda.is_available() else 0


def step_times(engine: Any, out: list[list[float]]) -> None:
    """Time every engine.step() into out[-1] (the current run's list)."""
    step = engine.step

    def timed() -> Any:
        t = time.perf_counter()
        result = step()
        out[-1].append(time.perf_counter() - t)
        return result

    engine.step = timed


def first_run_excess(steps: list[list[float]], top: int = 10) -> dict[str, Any]:
    """Run 0 against the per-step median of the later runs (they plan the same steps): total excess seconds, and
    the steps where most of it is."""
    n = min(len(r) for r in steps)
    later = [statistics.median(r[i] for r in steps[1:]) for i in range(n)]
    excess = [(steps[0][i] - later[i], i) for i in range(n)]
    worst = sorted(excess, reverse=True)[:top]
    return {"steps": n, "run0_excess_s": round(sum(e for e, _ in excess), 3),
            "worst_steps": [{"step": i, "excess_ms": round(e * 1e3, 2), "run0_ms": round(steps[0][i] * 1e3, 2)}
                            for e, i in worst]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--smoke", action="store_true", help="a tiny Qwen3 on any device, 4 short requests")
    ap.add_argument("--step-times", action="store_true", help="run 0's slowest steps against the later runs")
    args = ap.parse_args()

    log = log_compiles()
    cfg = dict(PRESETS["qwen3-0.6b"], num_hidden_layers=args.layers)
    if args.smoke:
        cfg.update(QWEN_SMOKE_SHAPE)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        llm = llm_for(cfg, Path(tmp), enable_prefix_caching=False)
    print(json.dumps({"init_s": round(time.perf_counter() - t0, 1), "compiles": len(log)}), flush=True)
    prompts, params = qwen_requests(cfg["vocab_size"], 4 if args.smoke else 256, 8 if args.smoke else None)
    rates: list[float] = []
    steps: list[list[float]] = []
    if args.step_times:
        step_times(llm.engine, steps)
    for run in range(args.runs):
        steps.append([])
        log.clear()
        allocs = cuda_mallocs()
        _, elapsed, tokens = gen(llm, prompts, params)
        allocs = cuda_mallocs() - allocs
        rates.append(tokens / elapsed)
        print(json.dumps({"run": run, "layers": args.layers, "elapsed_s": round(elapsed, 3),
                          "output_tok_s": round(tokens / elapsed, 1), "compiles": log[:], "cuda_mallocs": allocs}),
              flush=True)
    if args.step_times and len(steps) > 1:
        print(json.dumps(first_run_excess(steps)), flush=True)
    summary = {"layers": args.layers, "runs": args.runs,
               "median_tok_s": round(statistics.median(rates), 1), "min": round(min(rates), 1),
               "max": round(max(rates), 1)}
    print("RESULT", json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
