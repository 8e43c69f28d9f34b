"""Where the decode chain's time goes, for tools/lab_decode_chain.py (--timeline, --jitter, --host-loop): the
timeline probe's per-GEMV table (kernels/triton/probe.py) for the chain and variants of it, the spread of graph
replays on the device, and the engine's overlap pattern run without the engine."""
from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from lab_decode_chain import Chain, emit, graph_ms

from appliance.kernels.registry import get as op


def probe_replay(chain: Chain, reps: int) -> tuple[list[tuple[str, int]], torch.Tensor]:
    """The fused chain captured with the kernels' timeline probe (kernels/triton/probe.py) and replayed; the
    last replay's records."""
    from appliance.kernels.triton import probe as P

    P.TIMELINE = P.Timeline(4 * len(chain.layers), 1024, "cuda")
    try:
        chain.fused("triton")  # compiles the probed kernels
        torch.cuda.synchronize()
        P.TIMELINE.launches.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            chain.fused("triton")
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize()
        return list(P.TIMELINE.launches), P.TIMELINE.buf.cpu()
    finally:
        P.TIMELINE = None


def launch_rows(chain: Chain, launches: list[tuple[str, int]], buf: torch.Tensor) -> list[dict[str, Any]]:
    """Per GEMV launch, in microseconds: the gap from the previous GEMV's last program end to this one's first
    wait return (for o: the attention and its merge), the span from there to its last program end, the stream
    per program (median / max), the imbalance (last stream end - median stream end), the longest epilogue."""
    o, down = chain.layers[0]["o"], chain.layers[0]["down"]
    names = {"qkv": "qkv", f"residual {o.shape[0]}x{o.shape[1]}": "o", "silu": "gate_up",
             f"residual {down.shape[0]}x{down.shape[1]}": "down"}
    origin = int(buf[0, : launches[0][1], 0].min())
    rows, prev_end = [], None
    for r, (name, p) in enumerate(launches):
        t0, t1, t2, t3 = ((buf[r, :p, :4] - origin).double() / 1000.0).unbind(1)
        op_name = names.get(name, name)
        w = chain.layers[0][op_name]
        row = {"layer": r // 4, "op": op_name, "programs": p,
               "gap": float(t1.min() - prev_end) if prev_end is not None else float("nan"),
               "span": float(t3.max() - t1.min()), "stream_med": float((t2 - t1).median()),
               "stream_max": float((t2 - t1).max()), "imbalance": float(t2.max() - t2.median()),
               "epilogue": float((t3 - t2).max()), "resident_before_wait": float(t1.min() - t0.min()),
               "late_starts": int((t0 > t1.min()).sum()), "distinct_sms": int(buf[r, :p, 4].unique().numel())}
        row["GBps"] = w.numel() * w.element_size() / (row["span"] * 1e3)
        prev_end = float(t3.max())
        rows.append(row)
    return rows


TIMED = ("gap", "span", "stream_med", "imbalance", "epilogue")


def timeline(chain: Chain, m: int, reps: int, rounds: int) -> None:
    """Where each GEMV's time goes, for the chain as registered and for variants of it (one line each: per op
    the medians over layers 1..n-2 of TIMED, and the layer's median total), alternating `rounds` times; then one
    middle layer in full. The variants: the
    attention without its merge (wrong results: timing only); no attention."""
    from contextlib import ExitStack
    from unittest import mock

    from appliance.kernels.triton import decode

    class _Skip:  # a kernel launch that does nothing
        def __getitem__(self, grid: Any) -> Any:
            return lambda *a, **k: None

    variants: dict[str, list[Any]] = {
        "chain": [],
        "attention without merge": [mock.patch.object(decode, "_merge_kernel", _Skip())],
        "no attention": [mock.patch.object(chain, "attend", lambda q, i, backend: q.view(q.shape[0], -1))],
    }
    pooled: dict[str, list[list[dict[str, Any]]]] = {k: [] for k in variants}
    for _ in range(rounds):
        for name, patches in variants.items():
            with ExitStack() as stack:
                for patch in patches:
                    stack.enter_context(patch)
                launches, buf = probe_replay(chain, reps)
                rows = launch_rows(chain, launches, buf)
                pooled[name].append(rows)
                ms = graph_ms(lambda: chain.fused("triton"), reps)
            emit(rows=m, variant=name, graph_ms_unprobed=round(ms, 4))
    for name, runs in pooled.items():
        inner = [r for rows in runs for r in rows if 1 <= r["layer"] < len(chain.layers) - 1]
        per_op = {op: {k: round(statistics.median(r[k] for r in inner if r["op"] == op), 3) for k in TIMED}
                  for op in ("qkv", "o", "gate_up", "down")}
        layer_us = statistics.median(sum(r["gap"] + r["span"] for r in rows[4 * i: 4 * i + 4])
                                     for rows in runs for i in range(1, len(chain.layers) - 1))
        emit(rows=m, variant=name, layer_us=round(layer_us, 3), **per_op)
    for r in pooled["chain"][0][4 * (len(chain.layers) // 2): 4 * (len(chain.layers) // 2) + 4]:
        emit(rows=m, **{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})


def jitter(chain: Chain, m: int, n: int) -> None:
    """Replays the fused chain's graph n times back to back, each between CUDA events: whether single replays
    run slow now and then on the device itself (the batch-1 mean sat above its median in the runs)."""
    chain.fused("triton")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain.fused("triton")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for a, b in events:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    ms = [a.elapsed_time(b) for a, b in events]
    p50 = statistics.median(ms)
    slow = [(i, round(t, 3)) for i, t in enumerate(ms) if t > 1.2 * p50]
    emit(rows=m, replays=n, p50_ms=round(p50, 4), mean_ms=round(statistics.mean(ms), 4), max_ms=round(max(ms), 3),
         slow=len(slow), first_slow=slow[:10])


def host_loop(chain: Chain, m: int, n: int) -> None:
    """The engine's overlap pattern without the engine: each step replays the chain's graph, runs an eager LM
    head GEMV and argmax, copies the ids to pinned memory and records an event; the host launches step i + 1
    before waiting for step i. Gaps between the waits' returns far above their median are the driver's or the
    machine's, not the engine's Python."""
    head = torch.randn(128256, chain.x0.shape[1], device="cuda", dtype=chain.x0.dtype) / 64
    gemv = op("gemv", "triton")
    out = chain.fused("triton")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain.fused("triton")
    ids = [torch.empty(m, dtype=torch.int64).pin_memory() for _ in range(2)]

    def launch(i: int) -> torch.cuda.Event:
        graph.replay()
        ids[i % 2].copy_(gemv(out, head).argmax(-1), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return done

    arrivals, pending = [], launch(0)
    for i in range(1, n + 1):
        nxt = launch(i) if i < n else None
        pending.synchronize()
        arrivals.append(time.perf_counter())
        pending = nxt
    gaps = [(b - a) * 1e3 for a, b in zip(arrivals, arrivals[1:])]
    p50 = statistics.median(gaps)
    slow = [(i, round(g, 2)) for i, g in enumerate(gaps) if g > 1.2 * p50]
    emit(rows=m, steps=n, p50_ms=round(p50, 4), mean_ms=round(statistics.mean(gaps), 4), max_ms=round(max(gaps), 3),
         slow=len(slow), first_slow=slow[:10])
