"""Time the Triton `sample` op: one program per row (the old launch) against split rows (the new one).

    python tools/bench_sampler.py                      # GPU: the three shapes below, bf16 and fp32
    python tools/bench_sampler.py --programs-per-sm 4,8,16   # also sweep the chunk heuristic
    python tools/bench_sampler.py --smoke              # CPU, Triton's interpreter, tiny shapes (timings meaningless)

Shapes: greedy at batch 1 over 128,256 tokens (Llama-3 8B), temperature 1 at batch 256 over 151,936 (Qwen3), and
top-k 50 + top-p 0.9 at batch 256 over 151,936 (stays on the per-row path: it should not get slower). One JSON
line per (shape, dtype, variant): microseconds per call (CUDA events, median of --iters after --warmup), whether
the token ids equal the old launch's, and the chunk count. Every call reads a fresh copy of the logits (enough
copies to overflow L2) and starts after a short GPU sleep, so neither L2 nor the CPU's launch latency shows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

L2_BYTES = 50 * 2**20  # H100: 50 MiB; copies of the logits add up to at least twice this


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    vocab: int
    mode: str  # greedy, plain (temperature 1), filtered (top-k 50 + top-p 0.9)


GPU_SHAPES = (Shape("greedy-b1", 1, 128256, "greedy"), Shape("temp1-b256", 256, 151936, "plain"),
              Shape("topk50-topp0.9-b256", 256, 151936, "filtered"))
SMOKE_SHAPES = (Shape("greedy-b1", 1, 700, "greedy"), Shape("temp1-b4", 4, 300, "plain"),
                Shape("topk50-topp0.9-b2", 2, 300, "filtered"))


def settings(shape: Shape, device: str) -> tuple:
    import torch

    b = shape.batch
    temp = torch.zeros(b) if shape.mode == "greedy" else torch.ones(b)
    top_k = torch.full((b,), 50 if shape.mode == "filtered" else 0, dtype=torch.int32)
    top_p = torch.full((b,), 0.9 if shape.mode == "filtered" else 1.0)
    seeds, steps = torch.arange(b, dtype=torch.int64) * 7919, torch.full((b,), 17, dtype=torch.int64)
    return tuple(t.to(device) for t in (temp, top_k, top_p, torch.zeros(b), seeds, steps))


def time_gpu(fn: Callable[[int], object], copies: int, warmup: int, iters: int) -> float:
    import torch

    for i in range(warmup):
        fn(i % copies)
    times = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(100_000)  # ~50 us of GPU work: the launches below queue up behind it
        start.record()
        fn(i % copies)
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in times)


def time_cpu(fn: Callable[[int], object], copies: int, warmup: int, iters: int) -> float:
    for i in range(warmup):
        fn(i % copies)
    times = []
    for i in range(iters):
        t0 = time.perf_counter()
        fn(i % copies)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def bench(shape: Shape, dtype_name: str, device: str, ppsm: list[int], warmup: int, iters: int) -> list[dict]:
    import torch

    from appliance.kernels.triton import sampling as S

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    gen = torch.Generator().manual_seed(0)
    base = (3 * torch.randn(shape.batch, shape.vocab, generator=gen)).to(dtype).to(device)
    nbytes = base.numel() * base.element_size()
    copies = max(2, -(-2 * L2_BYTES // nbytes)) if device == "cuda" else 1
    pool = [base.clone() for _ in range(copies)]
    args = settings(shape, device)
    timer = time_gpu if device == "cuda" else time_cpu
    sms = torch.cuda.get_device_properties(0).multi_processor_count if device == "cuda" else 1
    old_ids = S.sample_per_row(base, *args)
    variants: list[tuple[str, int | None, Callable[[torch.Tensor], torch.Tensor]]] = [
        ("old", 0, lambda x: S.sample_per_row(x, *args)),
        ("new", S.chunks_for(shape.batch, shape.vocab, sms), lambda x: S.sample(x, *args))]
    for n in ppsm:
        variants.append((f"new-ppsm{n}", S.chunks_for(shape.batch, shape.vocab, sms, n),
                         lambda x, n=n: S.sample_split(x, *args, programs_per_sm=n)))
    rows, old_us = [], float("nan")
    for name, chunks, op in variants:
        us = timer(lambda i, op=op: op(pool[i]), copies, warmup, iters)
        old_us = us if name == "old" else old_us
        match = bool(torch.equal(op(base), old_ids))
        rows.append({"case": shape.name, "dtype": dtype_name, "variant": name, "chunks": chunks, "us": round(us, 2),
                     "speedup": round(old_us / us, 2), "match_old": match, "device": device})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU + Triton interpreter, tiny shapes")
    ap.add_argument("--programs-per-sm", default="", help="extra chunk heuristics to time, e.g. 4,8,16")
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    a = ap.parse_args(argv)
    if a.smoke:  # the interpreter must be chosen before triton is first imported
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    device = "cpu" if a.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --smoke)")
    shapes = SMOKE_SHAPES if a.smoke else GPU_SHAPES
    warmup, iters = (0, 1) if a.smoke else (a.warmup, a.iters)
    ppsm = [int(x) for x in a.programs_per_sm.split(",") if x]
    ok = True
    for shape in shapes:
        for dtype_name in a.dtypes.split(","):
            for row in bench(shape, dtype_name, device, ppsm, warmup, iters):
                ok &= row["match_old"]
                print(json.dumps(row), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
