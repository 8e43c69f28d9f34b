#!/usr/bin/env python3
"""Where a throughput run's steps go, by kind: the device time of each step, the device's wait for the host
between steps, and the host's phases (launch, schedule, apply results, wait for results).

    python3 tools/bench_steps.py [--preset qwen3-0.6b | llama-3.1-8b] [--prompts 256] [--runs 2]
    python3 tools/bench_steps.py --smoke           # a tiny Qwen3 on any device: checks the script

The workload is tools/bench_gpu.py's (Qwen3: in/out uniform [100, 1024], seed 0; Llama: 1024 in / 1024 out). Each
launch is bracketed by two CUDA events: `span` is the device time from the step's first queued work to its last
(it includes any wait inside the step for the host's next launch call), `wait` the device idle between one step's
last work and the next step's first. Steps are grouped as decode-only by batch size, or mixed / prefill (eager).
Prints one JSON line per run (with its per-kind device time and waits, its largest waits and the garbage
collector's pauses: runs of one process differ by several percent, and these say whether the device or the host
made a run slower), then one per kind for the last run (the first pays warm-up costs).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_offline import PRESETS
from step_diagnostics import GcPauses
from gpu_measure import (
    QWEN_SMOKE_SHAPE,
    _llm,
    _throughput,
    llama_workload,
    qwen_workload,
)

SMOKE = dict(PRESETS["qwen3-0.6b"], num_hidden_layers=1, **QWEN_SMOKE_SHAPE)
PHASES = ("launch", "schedule", "update", "collect")


class Clock:
    """A device timestamp: a CUDA event on a GPU, the host clock elsewhere (there every op is synchronous)."""

    def __init__(self, cuda: bool) -> None:
        import torch

        self.event = torch.cuda.Event(enable_timing=True) if cuda else None
        if self.event is not None:
            self.event.record()
        self.t = time.perf_counter()

    def ms_until(self, later: Clock) -> float:
        if self.event is not None and later.event is not None:
            return float(self.event.elapsed_time(later.event))
        return (later.t - self.t) * 1e3


def kind_of(num_decodes: int, num_tokens: int) -> str:
    if num_tokens != num_decodes:
        return "mixed / prefill"
    bound = next(b for b in (16, 64, 128, 256, 1 << 30) if num_decodes <= b)
    return f"decode b<={bound}" if bound < 1 << 30 else "decode b>256"


def instrument(llm: Any, steps: list[dict[str, Any]]) -> None:
    """Wrap the runner's launch and the engine's host phases; each launch appends a step record, and the host
    phases that follow it (planning the next step, applying and collecting earlier ones) are added to it."""
    import torch

    cuda = torch.cuda.is_available()
    runner, sched, executor = llm.executor.runner, llm.engine.scheduler, llm.executor
    launch, schedule, update, collect = runner.launch, sched.schedule, sched.update, executor.collect

    def timed(fn: Any, phase: str) -> Any:
        def wrapper(*args: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args)
            finally:
                if steps:
                    steps[-1][phase] += (time.perf_counter() - t) * 1e3
        return wrapper

    def launch_timed(plan: Any) -> Any:
        start, t = Clock(cuda), time.perf_counter()
        handle = launch(plan)
        decodes = sum(1 for s in plan.scheduled if s.num_tokens == 1)
        tokens = sum(s.num_tokens for s in plan.scheduled)
        steps.append({"start": start, "end": Clock(cuda), "kind": kind_of(decodes, tokens),
                      "launch": (time.perf_counter() - t) * 1e3, "schedule": 0.0, "update": 0.0, "collect": 0.0})
        return handle

    runner.launch = launch_timed
    sched.schedule, sched.update, executor.collect = (timed(schedule, "schedule"), timed(update, "update"),
                                                      timed(collect, "collect"))


def by_kind(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per kind: steps, device ms in steps, device ms waiting before the next step, host ms per step by phase."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for i, s in enumerate(steps):
        row = out[s["kind"]]
        row["steps"] += 1
        row["span_ms"] += s["start"].ms_until(s["end"])
        if i + 1 < len(steps):
            row["wait_ms"] += max(0.0, s["end"].ms_until(steps[i + 1]["start"]))
        for phase in PHASES:
            row[f"{phase}_ms"] += s[phase]
    return {kind: {"steps": int(r["steps"]), "span_ms": round(r["span_ms"], 1),
                   "span_ms_per_step": round(r["span_ms"] / r["steps"], 3), "wait_ms": round(r["wait_ms"], 1),
                   **{f"host_{p}_ms_per_step": round(r[f"{p}_ms"] / r["steps"], 3) for p in PHASES}}
            for kind, r in sorted(out.items())}


def run_summary(steps: list[dict[str, Any]], pauses: list[tuple[int, float]], top: int = 5) -> dict[str, Any]:
    """One run: device ms in steps and idle between them per kind, the largest waits (ms, the kind and index of
    the step after them) and the collector's pauses per generation (count, ms)."""
    rows = by_kind(steps)
    waits = sorted(((max(0.0, a["end"].ms_until(b["start"])), b["kind"], i + 1)
                    for i, (a, b) in enumerate(zip(steps, steps[1:]))), reverse=True)[:top]
    gcs: dict[str, list[float]] = {}
    for gen, ms in pauses:
        entry = gcs.setdefault(f"gen{gen}", [0, 0.0])
        entry[0] += 1
        entry[1] = round(entry[1] + ms, 2)
    return {"kinds": {k: [r["steps"], r["span_ms"], r["wait_ms"]] for k, r in rows.items()},
            "largest_waits": [[round(w, 2), k, i] for w, k, i in waits], "gc": gcs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b", choices=("qwen3-0.6b", "llama-3.1-8b"))
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--census", action="store_true", help="what each full garbage collection walks, by type")
    ap.add_argument("--chunk", type=int, default=None, help="scheduler.chunked_prefill_size (default: the config's)")
    args = ap.parse_args()
    import torch

    cfg = SMOKE if args.smoke else PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        extra = {} if args.chunk is None else {"chunked_prefill_size": args.chunk}
        llm = _llm(cfg, Path(tmp), enable_prefix_caching=False, **extra)
    runner = llm.executor.runner
    print(json.dumps({"num_kv_blocks": runner.num_blocks,
                      "chunked_prefill_size": llm.config.scheduler.chunked_prefill_size}), flush=True)
    k = 16 if args.smoke else 1
    if args.preset == "qwen3-0.6b":
        ids, out_lens = qwen_workload(cfg["vocab_size"], args.prompts // k, k)
        prompts = [{"prompt_token_ids": p} for p in ids]
    else:
        prompts, out_lens = llama_workload(cfg["vocab_size"], args.prompts // k, k)
    _throughput(llm, prompts[:16], [8] * len(prompts[:16]))  # compiles what the run meets
    steps: list[dict[str, Any]] = []
    instrument(llm, steps)
    census: list[dict[str, int]] | None = [] if args.census else None
    pauses = GcPauses(census)
    for run in range(args.runs):
        steps.clear()
        pauses.clear()
        frozen = gc.get_freeze_count()  # objects kept out of collections before the run (runtime/gc_heap.py)
        result = _throughput(llm, prompts, out_lens)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        print(json.dumps({"run": run, **result, **run_summary(steps, pauses), "frozen_before": frozen}), flush=True)
        if census:
            print(json.dumps({"run": run, "full_collections_walk": census}), flush=True)
            census.clear()
    for kind, row in by_kind(steps).items():
        print(json.dumps({"kind": kind, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
