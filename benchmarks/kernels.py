"""One command for a GPU: check every triton kernel against its torch reference, then time them.

    python -m benchmarks.kernels [--quick] [--sweep] [--json PATH]

Correctness runs appliance.kernels.triton.selfcheck.realistic_cases (bf16 and fp16, Llama-3.1-8B heads). Timing
uses triton.testing (median of the repeats, CUDA events) on random inputs: "us" is per call replayed from a CUDA
graph (GPU time, as the model runner's graphs see it), "eager_us" per plain launch (includes Python launch cost);
achieved GB/s counts the least bytes each kernel must move (selfcheck.Inputs.nbytes). --sweep also times decode
split-K factors and prefill tile / warp / stage settings. JSON goes to --json, or $OUT/kernels.json when OUT is set.
Needs only torch and triton: the appliance's server dependencies are not imported.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

import appliance.kernels.triton  # noqa: F401  (registers the ops)
from appliance.kernels.registry import get
from appliance.kernels.triton import decode, prefill
from appliance.kernels.triton import selfcheck as sc

# flashinfer 0.6.14 on an H100 80GB HBM3, median of 50 (docs/kernels.md).
FLASHINFER_US = {"decode b64 kv1024": 144.7, "prefill 8x512 over 512": 167.2, "rms_norm 256x4096": 17.1,
                 "sample 256x128256 k50 p0.9": 224.6}
BF = torch.bfloat16


REP_MS = {"full": (25, 100), "sweep": (10, 30)}
MODE = "full"


def bench(fn: Callable[[], Any]) -> float:
    """Median microseconds of eager launches (do_bench's warm-up and repeat arguments are milliseconds)."""
    warmup, rep = REP_MS[MODE]
    return 1000.0 * float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def bench_graph(fn: Callable[[], Any]) -> float:
    """Median microseconds per call replayed from a CUDA graph: the GPU time without Python launch overhead,
    which is how the model runner calls these ops (decode under CUDA graphs)."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    return 1000.0 * float(do_bench_cudagraph(fn, rep=REP_MS[MODE][1], return_mode="median"))


def check(rows: list[dict[str, Any]]) -> bool:
    ok_all = True
    for op, case, build in sc.realistic_cases("cuda"):
        try:
            res = sc.compare(op, build(), case)
            tol = 0.05 if op == "sample" else res.tol  # GPU log/exp vs CPU: a rare near-tie may flip a token
            ok = res.err <= tol
            rows.append({"op": op, "case": case, "err": res.err, "tol": tol, "ok": ok})
        except Exception as exc:  # noqa: BLE001  (report and go on: one broken op must not hide the rest)
            ok = False
            rows.append({"op": op, "case": case, "error": f"{type(exc).__name__}: {exc}", "ok": False})
        ok_all &= ok
        r = rows[-1]
        print(f"check {op:18s} {case:28s} {'ok ' if ok else 'FAIL'} err={r.get('err', r.get('error'))}",
              flush=True)
    torch.cuda.synchronize()
    return ok_all


def timed(name: str, op: str, inputs: sc.Inputs, flops: float = 0.0, ref_fn: bool = False,
          peer: str | None = None, **kwargs: Any) -> dict[str, Any]:
    fn = get(op, "triton")
    call = lambda: fn(*inputs.args, **kwargs)
    eager = bench(call)
    try:
        us = bench_graph(call)
    except Exception as exc:  # noqa: BLE001  (capture failed: report eager time and say so)
        print(f"graph capture failed for {name}: {type(exc).__name__}: {exc}", flush=True)
        us = eager
    row: dict[str, Any] = {"name": name, "op": op, "us": us, "eager_us": eager, "GB/s": inputs.nbytes / us / 1e3}
    if flops:
        row["TFLOP/s"] = flops / us / 1e6
    if ref_fn:
        ref = get(op, "torch")
        row["torch_us"] = bench(lambda: ref(*inputs.args))
    if peer:
        row["flashinfer_us"] = FLASHINFER_US[peer]
    return row


def attn_flops(q_lens: list[int], prefix: list[int], heads: int, dim: int) -> float:
    visible = sum(sum(p + j + 1 for j in range(n)) for n, p in zip(q_lens, prefix))
    return 4.0 * heads * dim * visible


def timings(quick: bool) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    dev = "cuda"
    batches = (1, 16, 64, 256) if quick else (1, 8, 16, 32, 64, 128, 256)
    for ctx in (1024, 4096):
        for bsz in batches:
            if bsz * ctx > 256 * 4096:
                continue
            inputs = sc.decode_inputs(bsz, 32, 8, 128, 16, [ctx] * bsz, BF, dev)
            peer = "decode b64 kv1024" if (bsz, ctx) == (64, 1024) else None
            rows.append(timed(f"decode b{bsz} kv{ctx}", "decode_attention", inputs, peer=peer))
            del inputs
    for q_lens, pre, label, peer in (([512] * 8, [512] * 8, "prefill 8x512 over 512", "prefill 8x512 over 512"),
                                     ([4096], [0], "prefill 1x4096", None),
                                     ([1024] * 4, [0] * 4, "prefill 4x1024", None),
                                     ([128] * 16, [2048] * 16, "extend 16x128 over 2048", None)):
        inputs = sc.prefill_inputs(q_lens, pre, 32, 8, 128, 16, BF, dev)
        rows.append(timed(label, "prefill_attention", inputs, flops=attn_flops(q_lens, pre, 32, 128), peer=peer))
    for t in (256, 4096):
        rows.append(timed(f"rms_norm {t}x4096", "rms_norm", sc.rms_norm_inputs(t, 4096, BF, dev, False),
                          ref_fn=True, peer="rms_norm 256x4096" if t == 256 else None))
        rows.append(timed(f"rms_norm+res {t}x4096", "rms_norm", sc.rms_norm_inputs(t, 4096, BF, dev, True),
                          ref_fn=True))
        rows.append(timed(f"rope neox {t} tok", "rope", sc.rope_inputs(t, 32, 8, 128, 128, True, BF, dev),
                          ref_fn=True))
        rows.append(timed(f"silu_and_mul {t}x14336", "silu_and_mul", sc.silu_inputs(t, 14336, BF, dev),
                          ref_fn=True))
        rows.append(timed(f"store_kv {t} tok", "store_kv", sc.store_kv_inputs(t, 8, 128, 16, BF, dev), ref_fn=True))
    greedy = sc.sample_inputs(256, 128256, BF, dev, "greedy")
    rows.append(timed("sample greedy 256x128256", "sample", greedy))
    plain = sc.sample_inputs(256, 128256, BF, dev, "plain")
    rows.append(timed("sample temp-only 256x128256", "sample", plain))
    filt = list(sc.sample_inputs(256, 128256, BF, dev, "plain").args)
    filt[2] = torch.full((256,), 50, dtype=torch.int32, device=dev)
    filt[3] = torch.full((256,), 0.9, device=dev)
    rows.append(timed("sample k50 p0.9 256x128256", "sample", sc.Inputs(tuple(filt), greedy.nbytes),
                      peer="sample 256x128256 k50 p0.9"))
    filt[2] = torch.zeros(256, dtype=torch.int32, device=dev)  # top-p alone: the bisection path
    rows.append(timed("sample p0.9 only 256x128256", "sample", sc.Inputs(tuple(filt), greedy.nbytes)))
    return rows


def sweep() -> list[dict[str, Any]]:
    """Decode: split factors at the default tile; prefill: tile shapes x warps x stages. Restores the defaults."""
    global MODE
    MODE = "sweep"
    rows: list[dict[str, Any]] = []
    for bsz, ctx in ((1, 4096), (8, 4096), (16, 1024), (64, 1024), (32, 4096)):
        inputs = sc.decode_inputs(bsz, 32, 8, 128, 16, [ctx] * bsz, BF, "cuda")
        auto = decode.num_splits_for(bsz, 8, ctx + 16, 132)
        for splits in (None, 1, 2, 4, 8, 16):
            r = timed(f"decode b{bsz} kv{ctx}", "decode_attention", inputs, num_splits=splits)
            r.update(splits=splits or f"auto({auto})")
            rows.append(r)
            print(f"sweep decode b{bsz} kv{ctx} splits={r['splits']}: {r['us']:.1f} us", flush=True)
    saved_p = (prefill.BLOCK_M, prefill.BLOCK_N, prefill.NUM_WARPS, prefill.NUM_STAGES)
    for q_lens, pre in (([512] * 8, [512] * 8), ([4096], [0]), ([128] * 16, [2048] * 16)):
        inputs = sc.prefill_inputs(q_lens, pre, 32, 8, 128, 16, BF, "cuda")
        for bm, bn, warps, stages in ((64, 64, 4, 2), (64, 64, 4, 3), (64, 32, 4, 2), (128, 64, 8, 2),
                                      (128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 32, 4, 3),
                                      (128, 64, 4, 3)):
            prefill.BLOCK_M, prefill.BLOCK_N, prefill.NUM_WARPS, prefill.NUM_STAGES = bm, bn, warps, stages
            name = f"prefill {len(q_lens)}x{q_lens[0]} over {pre[0]}"
            try:
                r = timed(name, "prefill_attention", inputs, flops=attn_flops(q_lens, pre, 32, 128))
            except Exception as exc:  # noqa: BLE001  (e.g. out of shared memory: skip the config)
                print(f"sweep skip bm={bm} bn={bn} w={warps} s={stages}: {type(exc).__name__}", flush=True)
                continue
            r.update(block_m=bm, block_n=bn, warps=warps, stages=stages)
            rows.append(r)
            print(f"sweep {name} bm={bm} bn={bn} w={warps} s={stages}: {r['us']:.1f} us "
                  f"{r['TFLOP/s']:.0f} TFLOP/s", flush=True)
    prefill.BLOCK_M, prefill.BLOCK_N, prefill.NUM_WARPS, prefill.NUM_STAGES = saved_p
    MODE = "full"
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    cols = ["name", "us", "eager_us", "GB/s", "TFLOP/s", "torch_us", "flashinfer_us"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            cells.append(f"{v:.1f}" if isinstance(v, float) else str(v))
        print("| " + " | ".join(cells) + " |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="fewer decode batch sizes")
    ap.add_argument("--sweep", action="store_true", help="also sweep decode/prefill tuning knobs")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks.kernels: no CUDA GPU", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(0)
    info = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "triton": triton.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "decode": {"BLOCK_N": decode.BLOCK_N, "BLOCK_N_UNSPLIT": decode.BLOCK_N_UNSPLIT, "warps": decode.NUM_WARPS,
                       "stages": decode.NUM_STAGES},
            "prefill": {"BLOCK_M": prefill.BLOCK_M, "BLOCK_N": prefill.BLOCK_N, "warps": prefill.NUM_WARPS,
                        "stages": prefill.NUM_STAGES}}
    print(json.dumps(info), flush=True)
    result: dict[str, Any] = {"info": info, "checks": [], "timings": [], "sweep": []}
    ok = True if args.no_check else check(result["checks"])
    t0 = time.time()
    if args.sweep:
        result["sweep"] = sweep()
        print(f"sweep took {time.time() - t0:.0f} s", flush=True)
    result["timings"] = timings(args.quick)
    path = args.json or (os.path.join(os.environ["OUT"], "kernels.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).write_text(json.dumps(result, indent=1))
    print_table(result["timings"])
    print("correctness:", "all ok" if ok else "FAILURES (see above)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
