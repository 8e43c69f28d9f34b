#!/usr/bin/env python3
"""A whole Llama-3.1-8B decode step without its LM head (32 layers, distinct random weights, the real decode
attention over a 1,024-token paged cache), as the layers run it today (ten kernels a layer) and as the fused
chain runs it (kernels/triton/gemv_chain.py: six), replayed from CUDA graphs: what the fusion is worth before
the model uses it. Each fused op is first checked against its torch reference on random inputs.

    python3 tools/lab_decode_chain.py [--rows 1,8] [--layers 32] [--reps 30]
    python3 tools/lab_decode_chain.py --sweep [--rows 1]     # the fused kernels' tiles, one weight at a time;
                                                               # then the decode attention's split count
    python3 tools/lab_decode_chain.py --timeline [--rows 1]  # where the chain's time goes: every GEMV program's
                                                               # start, wait, stream and end from one graph replay
    python3 tools/lab_decode_chain.py --jitter 3000 | --host-loop 3000   # graph replays' spread; the engine's
                                                               # step pattern without the engine (chain_timeline.py)
    ncu ... python3 tools/lab_decode_chain.py --ncu          # one layer's four GEMVs, eager, for Nsight Compute
    TRITON_INTERPRET=1 python3 tools/lab_decode_chain.py --smoke     # tiny shapes on the CPU: checks the script
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from kernel_lab import decode_case

import appliance.kernels.reference  # noqa: F401  (registers the torch ops)
import appliance.kernels.triton  # noqa: F401
from appliance.kernels.reference.rope import cos_sin_cache
from appliance.kernels.registry import get as op

LLAMA_8B = {"hidden": 4096, "inter": 14336, "heads": 32, "kv_heads": 8, "head_dim": 128, "context": 1024}
SMOKE = {"hidden": 128, "inter": 192, "heads": 4, "kv_heads": 2, "head_dim": 64, "context": 40}
PAGE = 16
EPS = 1e-5


def emit(**row: Any) -> None:
    print(json.dumps(row), flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


class Chain:
    """Weights, caches and attention metadata of `layers` layers for `rows` sequences of `context` tokens."""

    def __init__(self, shape: dict[str, int], layers: int, rows: int, dev: str, dtype: torch.dtype) -> None:
        h, inter, d = shape["hidden"], shape["inter"], shape["head_dim"]
        self.nq, self.nkv, self.d = shape["heads"], shape["kv_heads"], d
        qkv = (self.nq + 2 * self.nkv) * d

        def w(n: int, k: int) -> torch.Tensor:
            return torch.randn(n, k, device=dev, dtype=dtype) / k**0.5

        def g(n: int) -> torch.Tensor:
            return (torch.randn(n, device=dev) * 0.1 + 1).to(dtype)

        self.layers = [{"qkv": w(qkv, h), "o": w(h, self.nq * d), "gate_up": w(2 * inter, h), "down": w(h, inter),
                        "g1": g(h), "g2": g(h)} for _ in range(layers)]
        self.final = g(h)
        ctx = shape["context"]
        # the runner's power-of-two table width (executor/cuda_graph.width_bucket); one table, each layer's caches
        width = PAGE * max(16, 1 << (-(-(ctx + 1) // PAGE) - 1).bit_length())
        _, self.caches, self.table, self.lens, _ = decode_case([ctx + 1] * rows, self.nq, self.nkv, width, dev,
                                                               dtype, PAGE, copies=layers, d=d)
        self.positions = torch.full((rows,), ctx, dtype=torch.int64, device=dev)
        self.slots = self.table[:, ctx // PAGE].long() * PAGE + ctx % PAGE
        self.cos_sin = cos_sin_cache(d, ctx + 8).to(dev)
        self.x0 = torch.randn(rows, h, device=dev, dtype=dtype)
        self.scale = d**-0.5
        self.splits: int | None = None  # the decode attention's heuristic unless set

    def attend(self, q: torch.Tensor, i: int, backend: str) -> torch.Tensor:
        kc, vc = self.caches[i]
        out = op("decode_attention", backend)(q, kc, vc, self.table, self.lens, self.scale, num_splits=self.splits)
        return out.view(q.shape[0], -1)

    def unfused(self, backend: str, small: bool = True) -> torch.Tensor:
        """The layers as they run today; small=False leaves out the norms, rope+store and SiLU (a bound)."""
        gemv, norm = op("gemv", backend), op("rms_norm", backend)
        x, res = self.x0, None
        for i, p in enumerate(self.layers):
            if not small:
                h = x
            elif res is None:
                h, res = norm(x, p["g1"], EPS), x
            else:
                h, res = norm(x, p["g1"], EPS, res)
            qkv = gemv(h, p["qkv"])
            kc, vc = self.caches[i]
            if small:
                q = op("rope_store_kv", backend)(self.positions, qkv, self.nq, self.nkv, self.d, self.cos_sin, True,
                                                 None, None, 0.0, kc, vc, self.slots)
            else:
                q = qkv[:, : self.nq * self.d].reshape(-1, self.nq, self.d)
            o = gemv(self.attend(q, i, backend), p["o"])
            h, res = norm(o, p["g2"], EPS, res) if small else (o, res)
            gu = gemv(h, p["gate_up"])
            x = gemv(op("silu_and_mul", backend)(gu) if small else gu[:, : gu.shape[1] // 2], p["down"])
        return norm(x, self.final, EPS, res)[0] if small else x

    def fused(self, backend: str) -> torch.Tensor:
        res = self.x0.clone()
        xs, parts = op("norm_prep", backend)(res, self.layers[0]["g1"])
        for i, p in enumerate(self.layers):
            kc, vc = self.caches[i]
            q = op("gemv_normed_rope_store", backend)(xs, p["qkv"], None, parts, EPS, self.positions, self.nq,
                                                      self.nkv, self.d, self.cos_sin, kc, vc, self.slots)
            xs, parts = op("gemv_residual", backend)(self.attend(q, i, backend), p["o"], res, p["g2"])
            act = op("gemv_normed_silu", backend)(xs, p["gate_up"], parts, EPS)
            last = i + 1 == len(self.layers)
            out = op("gemv_residual", backend)(act, p["down"], res, None if last else self.layers[i + 1]["g1"])
            if not last:
                xs, parts = out
        return op("rms_norm", backend)(res, self.final, EPS)


def check_ops(shape: dict[str, int], rows: int, dev: str, dtype: torch.dtype) -> None:
    """Each fused op against its torch reference on one random layer (one layer, so errors do not compound)."""
    c = Chain(shape, 1, rows, dev, dtype)
    p, (kc, vc) = c.layers[0], c.caches[0]
    h = c.x0
    xs_t, parts_t = op("norm_prep", "triton")(h, p["g1"])
    xs_r, parts_r = op("norm_prep", "torch")(h, p["g1"])
    emit(op="norm_prep", xs=rel(xs_t, xs_r), sumsq=rel(parts_t.sum(1), parts_r.sum(1)))
    caches = {b: (kc.clone(), vc.clone()) for b in ("triton", "torch")}
    qs = {b: op("gemv_normed_rope_store", b)(xs_r, p["qkv"], None, parts_r, EPS, c.positions, c.nq, c.nkv, c.d,
                                              c.cos_sin, *caches[b], c.slots) for b in caches}
    written = {b: [cache.view(-1, c.nkv, c.d)[c.slots] for cache in caches[b]] for b in caches}
    emit(op="gemv_normed_rope_store", q=rel(qs["triton"], qs["torch"]),
         k=rel(written["triton"][0], written["torch"][0]), v=rel(written["triton"][1], written["torch"][1]))
    gu = {b: op("gemv_normed_silu", b)(xs_r, p["gate_up"], parts_r, EPS) for b in caches}
    emit(op="gemv_normed_silu", out=rel(gu["triton"], gu["torch"]))
    act = gu["torch"]
    res = {b: h.clone() for b in caches}
    out = {b: op("gemv_residual", b)(act, p["down"], res[b], p["g1"]) for b in caches}
    emit(op="gemv_residual", residual=rel(res["triton"], res["torch"]), xs=rel(out["triton"][0], out["torch"][0]),
         sumsq=rel(out["triton"][1].sum(1), out["torch"][1].sum(1)))


def graph_ms(fn: Any, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


SWEEP = {  # weight -> (block_n, block_k, num_stages, num_warps) candidates; the first is the default
    "qkv": [(64, 128, 6, 4), (64, 64, 8, 4), (64, 256, 4, 4), (64, 128, 5, 4), (64, 128, 7, 4), (64, 128, 6, 8)],
    "o": [(64, 128, 6, 4), (32, 256, 6, 4), (32, 256, 5, 4), (64, 256, 4, 4), (64, 128, 5, 4), (64, 128, 7, 4),
          (32, 128, 8, 4)],
    "gate_up": [(64, 128, 6, 4), (128, 128, 4, 8), (64, 256, 4, 4), (64, 128, 5, 4), (64, 128, 7, 4),
                (64, 128, 6, 8)],
    "down": [(32, 256, 6, 4), (64, 128, 6, 4), (32, 512, 3, 4), (32, 256, 5, 4), (32, 256, 7, 4), (32, 256, 6, 8)],
}


def sweep(chain: Chain, m: int, reps: int) -> None:
    """Coordinate descent over SWEEP (each weight's candidates with the others at their best so far), then the
    decode attention's split count; prints every timing and the winners."""
    from appliance.kernels.triton import gemv_chain

    shapes = {name: tuple(w.shape) for name, w in chain.layers[0].items() if name in SWEEP}
    best: dict[str, tuple[int, int, int, int]] = {}
    for name, candidates in SWEEP.items():
        times = {}
        for cand in candidates:
            gemv_chain.TILES.clear()
            gemv_chain.TILES.update({shapes[n]: t for n, t in best.items()})
            gemv_chain.TILES[shapes[name]] = cand
            try:
                times[cand] = min(graph_ms(lambda: chain.fused("triton"), reps) for _ in range(2))
            except Exception as exc:  # noqa: BLE001 - a tile that does not compile is a result too
                emit(rows=m, weight=name, tiles=cand, error=f"{type(exc).__name__}: {exc}"[:160])
                continue
            emit(rows=m, weight=name, tiles=cand, ms=round(times[cand], 4))
        best[name] = min(times, key=times.get)
    gemv_chain.TILES.clear()
    gemv_chain.TILES.update({shapes[n]: t for n, t in best.items()})
    for splits in (None, 16, 32, 64):
        chain.splits = splits
        emit(rows=m, splits=splits or "heuristic", ms=round(min(graph_ms(lambda: chain.fused("triton"), reps)
                                                                 for _ in range(2)), 4))
    chain.splits = None
    emit(rows=m, best_tiles={n: list(t) for n, t in best.items()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3, help="alternating timing rounds per variant")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--launch-next", default="2", help="gemv_chain.LAUNCH_NEXT values to time the chain with")
    ap.add_argument("--sweep", action="store_true", help="time the fused chain's tile and split candidates")
    ap.add_argument("--timeline", action="store_true", help="where each GEMV's time goes (gemv_chain.TIMELINE)")
    ap.add_argument("--ncu", action="store_true", help="two eager layers, three times, nothing else: for ncu")
    ap.add_argument("--jitter", type=int, default=0, help="replay the chain's graph N times: the spread of replays")
    ap.add_argument("--host-loop", type=int, default=0,
                    help="N steps of graph + eager LM head + argmax + id copy, one step ahead like overlap mode")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    shape = SMOKE if args.smoke else LLAMA_8B
    layers = 2 if args.smoke else args.layers
    torch.manual_seed(0)
    if args.ncu:
        chain = Chain(shape, 2, int(args.rows.split(",")[0]), dev, dtype)
        with torch.inference_mode():
            for _ in range(3):
                chain.fused("triton")
        torch.cuda.synchronize()
        return 0
    for m in [int(r) for r in args.rows.split(",")]:
        check_ops(shape, m, dev, dtype)
        chain = Chain(shape, layers, m, dev, dtype)
        with torch.inference_mode():
            base = chain.unfused("triton")
            fused = chain.fused("triton")
            emit(rows=m, check="fused vs unfused, final hidden", rel=rel(fused, base))
            if dev != "cuda":
                continue
            if args.sweep:
                sweep(chain, m, args.reps)
                continue
            if args.timeline or args.jitter or args.host_loop:
                import chain_timeline  # where the time goes (imports this module for Chain's helpers)

                if args.timeline:
                    chain_timeline.timeline(chain, m, args.reps, args.rounds)
                if args.jitter:
                    chain_timeline.jitter(chain, m, args.jitter)
                if args.host_loop:
                    chain_timeline.host_loop(chain, m, args.host_loop)
                continue
            from appliance.kernels.triton import gemv_chain

            def fused(launch_next: int, qkv_one_row: int = 1) -> Any:
                def run() -> torch.Tensor:
                    gemv_chain.LAUNCH_NEXT, gemv_chain.QKV_LAUNCH_NEXT_ONE_ROW = launch_next, qkv_one_row
                    return chain.fused("triton")
                return run

            variants = {"unfused": lambda: chain.unfused("triton"),
                        **{f"fused, LAUNCH_NEXT={v}": fused(int(v)) for v in args.launch_next.split(",")},
                        **({"fused, qkv at one row LAUNCH_NEXT=2": fused(2, 2)} if m == 1 else {}),
                        "gemv+attention only (bound)": lambda: chain.unfused("triton", small=False)}
            times: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    times[name].append(graph_ms(fn, args.reps))
            gemv_chain.LAUNCH_NEXT, gemv_chain.QKV_LAUNCH_NEXT_ONE_ROW = 2, 1
            for name, ts in times.items():
                emit(rows=m, layers=layers, variant=name, ms=round(statistics.median(ts), 4), rounds=ts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
