"""The skinny GEMM (appliance/kernels/triton/skinny_gemm.py) against cuBLAS at decode shapes, as a decode graph
runs them: whether it beats F.linear for 17 < M <= 256 rows and with which config. Needs only torch and triton.
Its summary lines give the entries of appliance/kernels/triton/skinny_gemm.py's TUNED (the wins of >= 1.08x).

    python -m tools.lab_gemm [--budget-s 210] [--models qwen3-0.6b,llama-3.1-8b] [--ms 32,64,128,192,256]
    TRITON_INTERPRET=1 python -m tools.lab_gemm --smoke      # tiny shapes on the CPU: checks the harness

Each variant is timed in a CUDA graph of REPS repetitions of [a small Triton elementwise kernel launched with
programmatic dependent launch that writes x, then the GEMM reading x] (a decode layer's dependency: the norm or
SiLU-and-mul before each linear layer), so launch and ramp latency and the PDL overlap are counted; the same chain
without the GEMMs is timed too, and us per GEMM = (chain - elementwise-only chain) / REPS: median over SAMPLES
timings of REPLAYS replays with CUDA events. The weights rotate over enough copies that the chain reads them from
HBM, not the 50 MB L2, as a real step does. Every replay's GEMM outputs are checked against F.linear in fp32
(max abs error; each repetition scales x differently, so a GEMM reading x before its gdc_wait shows up).

The sweep per (shape, M): the tiles (BLOCK_M, BLOCK_N, BLOCK_K, both orientations) without prefetch, then the
three fastest with PREFETCH 1 and 2 and the best with other stages / warps, then config_for's guess and the best
with PDL off. Past --budget-s only cuBLAS and the guess are timed. Configs that fail to compile or do not fit
(shared memory) are a row with "error", not a crash. Prints one JSON line per (model, shape, M, variant), then a
summary table (best Triton config vs cuBLAS) and one JSON "summary" line per (model, shape, M).
"""
from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from appliance.kernels.triton import common
from appliance.kernels.triton.common import pdl_enter, pdl_kwargs
from appliance.kernels.triton.skinny_gemm import (
    SkinnyGemmConfig,
    config_for,
    skinny_gemm,
)

MODELS: dict[str, dict[str, tuple[int, int]]] = {  # shape -> (N, K) of the weight
    "qwen3-0.6b": {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)},
    "llama-3.1-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}
SMOKE_MODELS = {"smoke": {"qkv": (96, 64), "down": (40, 160)}}
L2_BYTES = 50 << 20
SMEM_BYTES = 200 << 10  # of the H100's 227 KB per block: headroom for the layout conversions' scratch
REPLAYS, SAMPLES = 4, 7
T0 = time.time()
Chain = Callable[[], list[torch.Tensor]]


def emit(**row: Any) -> dict[str, Any]:
    print(json.dumps(row), flush=True)
    return row


@triton.jit
def _scale_kernel(src_ptr, dst_ptr, scale, n, BLOCK: tl.constexpr, GDC: tl.constexpr):
    pdl_enter(GDC)  # triggers the next launch at once, as the engine's small kernels do
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst_ptr + offs, (x * scale).to(dst_ptr.dtype.element_ty), mask=mask)


def scale_into(src: torch.Tensor, dst: torch.Tensor, scale: float) -> None:
    n = src.numel()
    _scale_kernel[(triton.cdiv(n, 1024),)](src, dst, scale, n, BLOCK=1024, num_warps=4, **pdl_kwargs(dst))


def scales(reps: int) -> list[float]:
    """Exact in bf16, and of alternating sign: a GEMM that read the last repetition's x gets -y."""
    return [(-1) ** i * (1.0 + i / 16) for i in range(reps)]


def make_chain(src: torch.Tensor, x: torch.Tensor, ws: list[torch.Tensor], reps: int,
               gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None) -> Chain:
    """REPS x [x = src * scale_i (PDL), y_i = gemm(x, W_{i mod copies})]; gemm None: the elementwise only."""
    def run() -> list[torch.Tensor]:
        ys = []
        for i, s in enumerate(scales(reps)):
            scale_into(src, x, s)
            if gemm is not None:
                ys.append(gemm(x, ws[i % len(ws)]))
        return ys
    return run


PDL = {"on": True}  # this lab's launches: with programmatic dependent launch where the GPU has it, or (pdl_off) none


@contextlib.contextmanager
def pdl_off() -> Iterator[None]:
    """Launches without programmatic dependent launch, captured or not (what PDL buys is the difference)."""
    saved = common.pdl_on
    PDL["on"], common.pdl_on = False, (lambda t: False)
    try:
        yield
    finally:
        PDL["on"], common.pdl_on = True, saved


def graph_us(run: Chain, smoke: bool) -> tuple[float, list[torch.Tensor]]:
    """Median microseconds of one replay of `run` captured in a CUDA graph, and the outputs of the last replay
    (the interpreter: NaN and one eager run)."""
    if smoke:
        return float("nan"), run()
    # one eager run with the launches the capture will make (pdl_kwargs asks for PDL under capture only), so that
    # every kernel compiles, and a config that does not compile or fit fails, outside the capture
    saved = common.pdl_on
    common.pdl_on = lambda t: PDL["on"] and t.is_cuda and torch.cuda.get_device_capability(t.device)[0] >= 9
    try:
        run()
    finally:
        common.pdl_on = saved
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = run()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(SAMPLES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            g.replay()
        end.record()
        end.synchronize()
        times.append(1000.0 * start.elapsed_time(end) / REPLAYS)
    return statistics.median(times), outs


def references(src: torch.Tensor, ws: list[torch.Tensor], reps: int) -> list[torch.Tensor]:
    """F.linear in fp32 of each repetition's x (rounded to x's dtype as the elementwise kernel stores it)."""
    wf = [w.float() for w in ws]
    return [F.linear((src.float() * s).to(src.dtype).float(), wf[i % len(ws)]) for i, s in enumerate(scales(reps))]


def tile_configs(m: int, smoke: bool) -> list[SkinnyGemmConfig]:
    """Phase one: the tiles and both orientations, no prefetch; warps and stages follow the tile size."""
    if smoke:
        return [SkinnyGemmConfig(bm, bn, 32, 4, 1, pf, wl) for bm, bn, pf, wl in
                ((16, 16, 0, False), (32, 16, 0, True), (16, 32, 1, False), (32, 32, 2, True), (16, 16, 2, False))]
    mp = 1 << max(m - 1, 1).bit_length()
    out = []
    for bm, bn, bk, wl in itertools.product((32, 64, 128), (16, 32, 64, 128), (64, 128), (False, True)):
        if bm > max(64, mp) or bm < mp // 4:
            continue  # more than half an M block of padding, or more M blocks than the grid needs
        stages = min(4, SMEM_BYTES // ((bm + bn) * bk * 2))
        if stages >= 2:
            out.append(SkinnyGemmConfig(bm, bn, bk, 8 if bm * bn >= 128 * 64 else 4, stages, 0, wl))
    return out


def refine_configs(top: list[SkinnyGemmConfig], smoke: bool) -> list[SkinnyGemmConfig]:
    """Phase two: PREFETCH 1 and 2 on the fastest tiles, then other stages and warps on the fastest of all."""
    if smoke:
        return [SkinnyGemmConfig(**{**top[0].__dict__, "prefetch": 1})]
    out = [SkinnyGemmConfig(**{**c.__dict__, "prefetch": p}) for c in top[:3] for p in (1, 2)]
    best = top[0]
    per_stage = (best.block_m + best.block_n) * best.block_k * 2
    out += [SkinnyGemmConfig(**{**best.__dict__, "num_stages": s}) for s in (2, 3, 5, 6)
            if s != best.num_stages and s * per_stage <= SMEM_BYTES]
    out.append(SkinnyGemmConfig(**{**best.__dict__, "num_warps": 4 if best.num_warps == 8 else 8}))
    return out


class Case:
    """One (model, shape, M): the buffers, the elementwise-only baseline, and the rows measured so far."""

    def __init__(self, model: str, shape: str, m: int, ws: list[torch.Tensor], reps: int, smoke: bool) -> None:
        self.model, self.shape, self.m, self.ws, self.reps, self.smoke = model, shape, m, ws, reps, smoke
        k = ws[0].shape[1]
        self.src = torch.randn(m, k, device=ws[0].device, dtype=ws[0].dtype)
        self.x = torch.empty_like(self.src)
        self.base: dict[bool, float] = {}  # the elementwise-only chain, with PDL and without
        self.rows: list[dict[str, Any]] = []
        self.ref_err = float("nan")
        self.swept = False
        self.errors = 0
        self.refs: list[torch.Tensor] = []

    def base_us(self) -> float:
        if PDL["on"] not in self.base:
            self.base[PDL["on"]] = graph_us(make_chain(self.src, self.x, self.ws, self.reps, None), self.smoke)[0]
        return self.base[PDL["on"]]

    def time(self, variant: str, gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
             cfg: SkinnyGemmConfig | None = None) -> dict[str, Any] | None:
        info = {"model": self.model, "shape": self.shape, "m": self.m, "variant": variant,
                **({} if cfg is None else cfg.__dict__)}
        try:
            us, outs = graph_us(make_chain(self.src, self.x, self.ws, self.reps, gemm), self.smoke)
            self.refs = self.refs or references(self.src, self.ws, self.reps)
            err = max(float((y.float() - ref).abs().max()) for y, ref in zip(outs, self.refs))
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is a result too
            self.errors += 1
            emit(section="gemm", **info, error=f"{type(exc).__name__}: {exc}"[:300])
            torch.cuda.synchronize() if not self.smoke else None
            return None
        if variant == "cublas":
            self.ref_err = err
        base = self.base_us()
        gemm_us = (us - base) / self.reps
        # cuBLAS's own error (fp32 accumulation, one rounding) sets the scale; a race on x is far above it
        ok = err <= 2 * (0.0 if math.isnan(self.ref_err) else self.ref_err) + 2e-2
        row = emit(section="gemm", **info, us=round(gemm_us, 3), chain_us=round(us, 2),
                   base_us=round(base, 2), pdl=PDL["on"], err=err, ok=ok)
        self.rows.append(row)
        return row

    def sweep(self, budget_left: Callable[[], bool]) -> None:
        self.time("cublas", lambda a, w: F.linear(a, w))
        n, k = self.ws[0].shape
        guess = config_for(self.m, n, k)
        self.time("triton-guess", lambda a, w: skinny_gemm(a, w, config=guess), guess)
        if budget_left():
            self.swept = True
            for cfg in tile_configs(self.m, self.smoke):
                if not budget_left():
                    break
                self.time("triton", lambda a, w, c=cfg: skinny_gemm(a, w, config=c), cfg)
            ranked = self.ranked()
            if ranked:
                top = [SkinnyGemmConfig(**{f: r[f] for f in SkinnyGemmConfig.__dataclass_fields__}) for r in ranked]
                for cfg in refine_configs(top, self.smoke):
                    if not budget_left():
                        break
                    self.time("triton", lambda a, w, c=cfg: skinny_gemm(a, w, config=c), cfg)
        best = self.best()
        if best is not None:  # what PDL (with the prefetch) buys: the same launches without it
            cfg = SkinnyGemmConfig(**{f: best[f] for f in SkinnyGemmConfig.__dataclass_fields__})
            with pdl_off():
                self.time("triton-best-nopdl", lambda a, w: skinny_gemm(a, w, config=cfg), cfg)

    def ranked(self) -> list[dict[str, Any]]:
        rows = [r for r in self.rows if r["variant"] in ("triton", "triton-guess") and r["ok"]]
        return sorted(rows, key=lambda r: (math.isnan(r["us"]), r["us"]))

    def best(self) -> dict[str, Any] | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def summary(self) -> dict[str, Any]:
        def us(variant: str) -> float | None:
            return next((r["us"] for r in self.rows if r["variant"] == variant), None)

        best = self.best()
        cublas = us("cublas")
        cfg = None if best is None else {f: best[f] for f in SkinnyGemmConfig.__dataclass_fields__}
        speedup = (cublas / best["us"] if best and cublas and best["us"] > 0 else None)
        return emit(section="summary", model=self.model, shape=self.shape, m=self.m, cublas_us=cublas,
                    guess_us=us("triton-guess"), best_us=None if best is None else best["us"],
                    best_nopdl_us=us("triton-best-nopdl"), speedup=speedup, best_cfg=cfg,
                    swept=self.swept, variants=len(self.rows), failed=sum(not r["ok"] for r in self.rows),
                    errors=self.errors,
                    worst_err=max((r["err"] for r in self.rows), default=None), cublas_err=self.ref_err)


def weights(n: int, k: int, reps: int, dev: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Enough distinct copies (at most reps) that one chain reads 3x the L2 in weights: HBM, as in a real step."""
    copies = min(reps, max(2, math.ceil(3 * L2_BYTES / (n * k * 2))))
    return [torch.randn(n, k, device=dev, dtype=dtype) / k**0.5 for _ in range(copies)]


def fmt(v: float | None, spec: str = "7.2f") -> str:
    return " " * (int(spec.split(".")[0]) - 1) + "-" if v is None or math.isnan(v) else format(v, spec)


def print_table(summaries: list[dict[str, Any]]) -> None:
    print("\nmodel         shape    M   cuBLAS us  guess us  best us  no-PDL us  speedup  worst err  best config")
    for s in summaries:
        c = s["best_cfg"]
        desc = ("-" if c is None else f"{c['block_m']}x{c['block_n']}x{c['block_k']} w{c['num_warps']} "
                f"s{c['num_stages']} pf{c['prefetch']} {'W@xT' if c['w_left'] else 'x@WT'}")
        print(f"{s['model']:13s} {s['shape']:8s} {s['m']:3d}  {fmt(s['cublas_us'], '9.2f')} "
              f"{fmt(s['guess_us'], '9.2f')} {fmt(s['best_us'], '8.2f')} {fmt(s['best_nopdl_us'], '10.2f')} "
              f"{fmt(s['speedup'], '8.2f')} {fmt(s['worst_err'], '10.4f')}  {desc}  "
              f"({s['failed']} wrong, {s['errors']} did not run{'' if s['swept'] else ', not swept: budget'})",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=210.0, help="stop sweeping (cuBLAS + guess only) after this")
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.1-8b")
    ap.add_argument("--shapes", default="", help="comma list of shape names to keep (default: all)")
    ap.add_argument("--ms", default="32,64,128,192,256")
    ap.add_argument("--reps", type=int, default=20, help="[elementwise, GEMM] pairs per graph")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if args.smoke:
        models, ms, reps, dev, dtype = SMOKE_MODELS, (17, 40), 2, "cpu", torch.bfloat16
    else:
        if not torch.cuda.is_available():
            raise SystemExit("lab_gemm: needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
        models = {name: MODELS[name] for name in args.models.split(",")}
        ms, reps, dev, dtype = tuple(int(m) for m in args.ms.split(",")), args.reps, "cuda", torch.bfloat16
    torch.manual_seed(0)
    emit(section="setup", device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
         triton=triton.__version__, torch=torch.__version__, reps=reps, pdl=PDL["on"], budget_s=args.budget_s)
    summaries = []
    for model, shapes in models.items():
        for shape, (n, k) in shapes.items():
            if args.shapes and shape not in args.shapes.split(","):
                continue
            ws = weights(n, k, reps, dev, dtype)
            for m in ms:
                case = Case(model, shape, m, ws, reps, args.smoke)
                case.sweep(lambda: time.time() - T0 < args.budget_s)
                summaries.append(case.summary())
            del ws
            torch.cuda.empty_cache() if dev == "cuda" else None
    print_table(summaries)
    emit(section="done", elapsed_s=round(time.time() - T0, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
