"""The FP8 GEMV (appliance/kernels/triton/fp8_gemv.py) at decode rows, swept over its tiles as a decode graph runs
it, against cuBLASLt (activation quantization + torch._scaled_mm) and the 16-bit GEMV on the dequantized weight.
`--emit` writes the winners to appliance/kernels/tuned/<arch>_fp8_gemv.json, which fp8_gemv reads.

    python -m tools.lab_fp8_gemv [--budget-s 240] [--ms 1] [--emit]
    TRITON_INTERPRET=1 python -m tools.lab_fp8_gemv --smoke      # tiny shapes on the CPU: checks the harness

Timing is tools/lab_gemm.py's: REPS x [a PDL elementwise kernel writing x, the GEMV reading it] in one CUDA graph,
minus the elementwise-only graph, over enough weight copies that the weights come from HBM. Every config's
outputs are checked against F.linear on the dequantized weight (x quantized per token: the error scale is
cuBLASLt's own error). One JSON line per (shape, M, variant), then one "summary" line per (shape, M).
"""
from __future__ import annotations

import argparse
import itertools
import math
import time
from typing import Any

import torch
import torch.nn.functional as F
import triton

from appliance.kernels import tuned
from appliance.kernels.fp8_gemm import FP8, FP8_MAX
from appliance.kernels.triton.act_quant import quant_act
from appliance.kernels.triton.fp8_gemv import Fp8GemvConfig, config_for, fp8_gemv
from appliance.kernels.triton.gemv import gemv
from tools.lab_gemm import (
    L2_BYTES,
    MODELS,
    SMEM_BYTES,
    T0,
    emit,
    graph_us,
    make_chain,
    scales,
)

SMOKE_SHAPES = {"qkv": (96, 64), "down": (40, 160)}
GENERATOR = "python -m tools.lab_fp8_gemv --emit"


def quantized(n: int, k: int, reps: int, dev: str) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
    """e4m3 weights [N, K] with one scale per row: enough copies that a chain reads 3x the L2 (HBM, as a step
    does); the scales by the weight's data pointer (the chain hands the GEMM only the weight)."""
    copies = min(reps, max(2, math.ceil(3 * L2_BYTES / (n * k))))
    ws, scale_of = [], {}
    for _ in range(copies):
        w = torch.randn(n, k, device=dev) / k**0.5
        s = w.abs().amax(dim=1) / FP8_MAX
        wq = (w / s[:, None]).to(FP8)
        ws.append(wq)
        scale_of[wq.data_ptr()] = s
    return ws, scale_of


def tile_configs(smoke: bool) -> list[Fp8GemvConfig]:
    if smoke:
        return [Fp8GemvConfig(16, 32, 4, 2), Fp8GemvConfig(32, 64, 4, 2)]
    out = []
    for bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (128, 256, 512, 1024), (4, 8), (3, 4, 6)):
        if stages * (bn + 16) * bk <= SMEM_BYTES and not (warps == 8 and bn < 64):
            out.append(Fp8GemvConfig(bn, bk, warps, stages))
    return out


class Case:
    """One (shape, M): the buffers, the references and the rows measured."""

    def __init__(self, shape: str, n: int, k: int, m: int, reps: int, dev: str, smoke: bool) -> None:
        self.shape, self.n, self.k, self.m, self.reps, self.smoke = shape, n, k, m, reps, smoke
        self.ws, self.scale_of = quantized(n, k, reps, dev)
        self.src = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        self.x = torch.empty_like(self.src)
        deq = [(w.float() * self.scale_of[w.data_ptr()][:, None]) for w in self.ws]
        self.refs = [F.linear((self.src.float() * s).to(self.src.dtype).float(), deq[i % len(deq)])
                     for i, s in enumerate(scales(reps))]
        self.w16 = [d.to(torch.bfloat16) for d in deq]
        self.base = graph_us(make_chain(self.src, self.x, self.ws, reps, None), smoke)[0]
        self.rows: list[dict[str, Any]] = []
        self.ref_err = float("nan")

    def time(self, variant: str, gemm: Any, cfg: Fp8GemvConfig | None = None) -> None:
        info = {"shape": self.shape, "n": self.n, "k": self.k, "m": self.m, "variant": variant,
                **({} if cfg is None else cfg.__dict__)}
        try:
            us, outs = graph_us(make_chain(self.src, self.x, self.ws, self.reps, gemm), self.smoke)
            err = max(float((y.float() - ref).abs().max()) for y, ref in zip(outs, self.refs))
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit is a result too
            emit(section="gemv", **info, error=f"{type(exc).__name__}: {exc}"[:300])
            torch.cuda.synchronize() if not self.smoke else None
            return
        if variant == "cublaslt":
            self.ref_err = err
        ok = err <= 2 * (0.0 if math.isnan(self.ref_err) else self.ref_err) + 5e-2
        self.rows.append(emit(section="gemv", **info, us=round((us - self.base) / self.reps, 3), err=err, ok=ok))

    def sweep(self, budget_left: Any) -> None:
        so = self.scale_of

        def cublaslt(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            xq, xs = quant_act(x, None)
            return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=so[w.data_ptr()].reshape(1, -1),
                                    out_dtype=x.dtype)

        w16 = {w.data_ptr(): w16 for w, w16 in zip(self.ws, self.w16)}
        self.time("cublaslt", cublaslt)
        self.time("bf16-gemv", lambda x, w: gemv(x, w16[w.data_ptr()]))
        guess = config_for(self.n, self.k)
        self.time("guess", lambda x, w: fp8_gemv(x, w, so[w.data_ptr()], None, config=guess), guess)
        for cfg in tile_configs(self.smoke):
            if not budget_left():
                break
            self.time("triton", lambda x, w, c=cfg: fp8_gemv(x, w, so[w.data_ptr()], None, config=c), cfg)

    def best(self) -> dict[str, Any] | None:
        rows = [r for r in self.rows if r["variant"] in ("triton", "guess") and r["ok"]]
        return min(rows, key=lambda r: r["us"]) if rows else None

    def summary(self) -> dict[str, Any]:
        def us(variant: str) -> float | None:
            return next((r["us"] for r in self.rows if r["variant"] == variant), None)

        best = self.best()
        cfg = None if best is None else {f: best[f] for f in ("block_n", "block_k", "num_warps", "num_stages")}
        gbps = None if best is None or best["us"] <= 0 else self.n * self.k / best["us"] / 1e3
        return emit(section="summary", shape=self.shape, n=self.n, k=self.k, m=self.m, cublaslt_us=us("cublaslt"),
                    bf16_gemv_us=us("bf16-gemv"), guess_us=us("guess"), best_us=None if best is None else best["us"],
                    best_weight_gb_s=gbps, best_cfg=cfg, variants=len(self.rows),
                    failed=sum(not r["ok"] for r in self.rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop sweeping (baselines + guess only) after this")
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--ms", default="1", help="decode rows; the table's tiles are the winners at the first")
    ap.add_argument("--reps", type=int, default=20, help="[elementwise, GEMV] pairs per graph")
    ap.add_argument("--emit", action="store_true", help="write the winners to the tuned table")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU under TRITON_INTERPRET=1")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("lab_fp8_gemv: needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)")
    shapes = SMOKE_SHAPES if args.smoke else MODELS[args.model]
    dev, reps = ("cpu", 2) if args.smoke else ("cuda", args.reps)
    ms = [int(m) for m in args.ms.split(",")]
    torch.manual_seed(0)
    device = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    emit(section="setup", device=device, triton=triton.__version__, torch=torch.__version__, reps=reps)
    per_shape_budget = args.budget_s / max(1, len(shapes) * len(ms))
    entries: dict[str, Any] = {}
    for (shape, (n, k)), m in itertools.product(shapes.items(), ms):
        start = time.time()
        case = Case(shape, n, k, m, reps, dev, args.smoke)
        case.sweep(lambda t0=start: time.time() - t0 < per_shape_budget)
        s = case.summary()
        if m == ms[0] and s["best_cfg"] is not None:
            entries.setdefault(tuned.shape_key(n, k), s["best_cfg"])
        del case
        torch.cuda.empty_cache() if dev == "cuda" else None
    if args.emit and not args.smoke:
        arch = tuned.arch_name(torch.cuda.get_device_capability())
        path = tuned.write("fp8_gemv", arch, f"{GENERATOR} --model {args.model} --ms {args.ms}", device, entries)
        emit(section="emitted", path=str(path), entries=entries)
    emit(section="done", elapsed_s=round(time.time() - T0, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
