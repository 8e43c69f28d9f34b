#!/usr/bin/env python3
"""Where the host time of the eager (mixed / prefill) steps goes: the Qwen3-0.6B throughput workload run twice,
every eager forward timed on the host and on the device, and profiled with cProfile in the second run.

    python3 tools/lab_eager.py [--runs 2] [--top 30] [--smoke]
    python3 tools/lab_eager.py --forward [--smoke]     # one eager forward, timed alone, PDL on and off
    python3 tools/lab_eager.py --first-run [--runs 2]  # what the first run of a process pays that later ones don't

Prints per run the eager steps' count, host ms and device ms (mean, and the first three), then the functions
with the most own time inside eager forwards of the last run. --forward times the model's eager forward of a
prefill step (12 x 680 tokens) and of a mixed one (100 decode rows + 12 x 674 tokens), the same token count
again and a new one each time, with programmatic dependent launch on and off, and the host cost of single
launches (a Triton RMSNorm, a cuBLAS GEMM).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_offline import PRESETS
from bench_overlap import gen, llm_for
from gpu_measure import QWEN_SMOKE_SHAPE, qwen_requests


def instrument(runner: Any, record: list[dict[str, float]], prof: cProfile.Profile, profiling: list[bool]) -> None:
    import torch

    cuda = torch.cuda.is_available()
    forward = runner._forward

    def timed(chunks: list[Any]) -> Any:
        if all(c.num_tokens == 1 for c in chunks):
            return forward(chunks)
        a = torch.cuda.Event(enable_timing=True) if cuda else None
        if a is not None:
            a.record()
        t = time.perf_counter()
        if profiling[0]:
            prof.enable()
        try:
            return forward(chunks)
        finally:
            if profiling[0]:
                prof.disable()
            host = (time.perf_counter() - t) * 1e3
            b = torch.cuda.Event(enable_timing=True) if cuda else None
            if b is not None:
                b.record()
            record.append({"tokens": sum(c.num_tokens for c in chunks), "host_ms": host, "events": (a, b)})

    runner._forward = timed


def forward_ab(llm: Any, smoke: bool) -> None:
    import torch

    from appliance.engine.sampling_params import SamplingParams as Params
    from appliance.executor.input_batch import Chunk, build_inputs
    from appliance.executor.request_table import RequestState
    from appliance.kernels.triton import common

    runner = llm.executor.runner
    bs, cuda = runner.block_size, torch.cuda.is_available()
    next_block = [1]

    def state(name: str, n: int) -> RequestState:
        blocks = list(range(next_block[0], next_block[0] + -(-(n + 1) // bs)))
        next_block[0] += len(blocks)
        return RequestState(name, [7] * (n + 1), n + 1, 0, blocks, Params())

    k = 16 if smoke else 1
    pre = [state(f"p{i}", 680 // k) for i in range(12)]
    dec = [state(f"d{i}", 500 // k) for i in range(100 // k)]
    cases = {"prefill": lambda extra: [Chunk(s, 0, 680 // k - extra * (i == 0), True) for i, s in enumerate(pre)],
             "mixed": lambda extra: ([Chunk(s, 500 // k, 1, True) for s in dec]
                                     + [Chunk(s, 0, 674 // k - extra * (i == 0), True) for i, s in enumerate(pre)])}

    def once(chunks: list[Any]) -> tuple[float, float]:
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        inputs = build_inputs(chunks, bs, runner.device, 1, runner._stager, runner._pad_prefills)
        runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        host = time.perf_counter() - t
        if cuda:
            torch.cuda.synchronize()
        return host * 1e3, (time.perf_counter() - t) * 1e3

    real_pdl_on = common.pdl_on
    with torch.inference_mode():
        for pdl in (True, False, True, False):
            common.pdl_on = real_pdl_on if pdl else (lambda t: False)
            for name, make in cases.items():
                same = [once(make(0)) for _ in range(4)][1:]
                new = [once(make(1 + i)) for i in range(3)]
                row = {"pdl": pdl, "case": name, "tokens": sum(c.num_tokens for c in make(0))}
                for label, got in (("same", same), ("new_count", new)):
                    row[label] = {"host_ms": [round(h, 2) for h, _ in got], "wall_ms": [round(w, 2) for _, w in got]}
                print(json.dumps(row), flush=True)
        x = torch.randn(4, 1024, device=runner.device, dtype=torch.bfloat16)
        w = torch.ones(1024, device=runner.device, dtype=torch.bfloat16)
        lin = torch.randn(1024, 1024, device=runner.device, dtype=torch.bfloat16)
        from appliance.kernels.triton.norm import rms_norm

        for pdl in (True, False):
            common.pdl_on = real_pdl_on if pdl else (lambda t: False)
            for label, fn in (("triton_rms_norm", lambda: rms_norm(x, w, 1e-6)),
                              ("torch_linear", lambda: torch.nn.functional.linear(x, lin))):
                if smoke and label.startswith("triton"):
                    continue
                fn()
                if cuda:
                    torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(500):
                    fn()
                host = (time.perf_counter() - t) / 500 * 1e6
                if cuda:
                    torch.cuda.synchronize()
                print(json.dumps({"pdl": pdl, "launch": label, "host_us": round(host, 2)}), flush=True)
    common.pdl_on = real_pdl_on


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--forward", action="store_true")
    ap.add_argument("--first-run", action="store_true",
                    help="cProfile every whole run; print the functions whose own time in run 0 exceeds the last "
                         "run's the most (what a process pays once)")
    args = ap.parse_args()
    import torch

    cfg = dict(PRESETS["qwen3-0.6b"])
    if args.smoke:
        cfg.update(QWEN_SMOKE_SHAPE, num_hidden_layers=2)
    misses: list[tuple[float, str]] = []
    if args.first_run:
        watch_triton(misses)
    with tempfile.TemporaryDirectory() as tmp:
        llm = llm_for(cfg, Path(tmp), enable_prefix_caching=False)
    if args.first_run:  # a check that the hook fires: the warm-up compiles every variant it meets
        print(json.dumps({"warmup_s": round(llm.executor.runner.warmup_s, 2), "warmup_triton_misses": len(misses)}))
    if args.forward:
        forward_ab(llm, args.smoke)
        return 0
    prompts, params = qwen_requests(cfg["vocab_size"], 8 if args.smoke else 256, 8 if args.smoke else None)
    record: list[dict[str, Any]] = []
    prof, profiling = cProfile.Profile(), [False]
    instrument(llm.executor.runner, record, prof, profiling)
    whole: list[dict[Any, Any]] = []
    for run in range(args.runs):
        record.clear()
        misses.clear()
        profiling[0] = run == args.runs - 1 and not args.first_run
        run_prof = cProfile.Profile() if args.first_run else None
        if run_prof is not None:
            run_prof.enable()
        mallocs = device_allocs()
        _, elapsed, tokens = gen(llm, prompts, params)
        mallocs = [b - a for a, b in zip(mallocs, device_allocs())]
        if run_prof is not None:
            run_prof.disable()
            whole.append(pstats.Stats(run_prof).stats)  # type: ignore[attr-defined]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for r in record:
            a, b = r.pop("events")
            r["device_ms"] = a.elapsed_time(b) if a is not None else r["host_ms"]
        n = max(1, len(record))
        print(json.dumps({"run": run, "elapsed_s": round(elapsed, 3), "tok_s": round(tokens / elapsed, 1),
                          "eager_steps": len(record), "cuda_malloc_free": mallocs,
                          "host_ms_mean": round(sum(r["host_ms"] for r in record) / n, 2),
                          "device_ms_mean": round(sum(r["device_ms"] for r in record) / n, 2),
                          "first": [{k: round(v, 2) for k, v in r.items()} for r in record[:3]]}), flush=True)
        for _, what in misses:
            print(json.dumps({"run": run, "triton_miss": what[:300]}), flush=True)
    if args.first_run and len(whole) > 1:
        print_first_run_excess(whole[0], whole[-1], args.top)
        return 0
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
    print(out.getvalue()[-12000:], flush=True)
    return 0


def device_allocs() -> list[int]:
    """cudaMalloc and cudaFree calls of the caching allocator so far (a run that grows the pool stalls)."""
    import torch

    if not torch.cuda.is_available():
        return [0, 0]
    stats = torch.cuda.memory_stats()
    return [int(stats.get("num_device_alloc", 0)), int(stats.get("num_device_free", 0))]


def watch_triton(log: list[tuple[float, str]]) -> None:
    """Log every Triton in-memory cache miss (a new specialisation compiled or loaded from disk) with its time:
    what a run meets that the warm-up did not launch."""
    from triton import knobs

    def hook(**kw: Any) -> None:
        log.append((time.perf_counter(), str(kw.get("repr", "?"))))

    knobs.runtime.jit_cache_hook = hook


def print_first_run_excess(first: dict[Any, Any], last: dict[Any, Any], top: int) -> None:
    """One JSON line per function, most own time gained in the first run first (pstats rows: cc, nc, tt, ct)."""
    excess = []
    for key, (_, calls, own, _, _) in first.items():
        base = last.get(key, (0, 0, 0.0, 0.0, None))
        excess.append((own - base[2], calls - base[1], key))
    for extra_s, extra_calls, (path, line, name) in sorted(excess, reverse=True)[:top]:
        print(json.dumps({"extra_ms": round(extra_s * 1e3, 2), "extra_calls": extra_calls,
                          "function": f"{Path(path).name}:{line}:{name}"}), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
