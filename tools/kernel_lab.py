#!/usr/bin/env python3
"""Tuning sweeps for the decode-step kernels on one GPU: the skinny GEMV against cuBLAS, decode attention on
ragged batches (the registered kernel's knobs), and the attention prologue (q/k norm + rope + KV store) fused vs
the unfused chain. Prints one JSON line per measurement, then a summary; needs only torch and triton.

    python3 tools/kernel_lab.py [--only gemv,chain,decode,rope_store] [--budget-s 300]
    TRITON_INTERPRET=1 python3 tools/kernel_lab.py --smoke      # tiny shapes on the CPU: checks the script

Timing: median per call replayed from a CUDA graph (triton.testing.do_bench_cudagraph). Every timed call cycles
over COPIES distinct weight / cache tensors, so nothing is served from the 50 MB L2 (as in a real step, where 15
GB of weights pass between two reads of one layer). GB/s = bytes the op must read / time.
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F

import appliance.kernels.triton  # noqa: F401  (registers the ops)
from appliance.kernels.reference.rope import cos_sin_cache
from appliance.kernels.registry import get as get_op
from appliance.kernels.triton import decode, gemv

COPIES = 4
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
            "lm_head": (128256, 4096)}
SMOKE = {"qkv": (96, 64), "o": (64, 64), "gate_up": (320, 64), "down": (64, 160), "lm_head": (100, 64)}
# attention prologue shapes: (q heads, kv heads, head_dim, per-head q/k RMSNorm)
PROLOGUE = {"qwen3-0.6b": (16, 8, 128, True), "llama-8b": (32, 8, 128, False)}
T0 = time.time()


def emit(**row: Any) -> dict[str, Any]:
    print(json.dumps(row), flush=True)
    return row


def timed_us(fn: Callable[[], Any], smoke: bool) -> float:
    fn()
    if smoke:
        return float("nan")
    from triton.testing import do_bench_cudagraph

    torch.cuda.synchronize()
    return 1000.0 * float(do_bench_cudagraph(fn, rep=30, return_mode="median")) / COPIES


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def gemv_configs(smoke: bool, tall: bool) -> list[gemv.GemvConfig]:
    """The sweep; `tall` (few output columns, long K: the down projection) adds narrow tiles and split-K."""
    if smoke:
        return [gemv.GemvConfig(16, 32, s, 4, 2) for s in (1, 2)]
    out = [gemv.GemvConfig(bn, bk, 1, 4, st) for bn, bk, st in itertools.product((16, 32, 64), (128, 256, 512), (3, 5))]
    out += [gemv.GemvConfig(bn, bk, 1, w, st) for bn, bk, w, st in
            itertools.product((32, 64, 128), (128, 256), (4, 8), (4, 6)) if bn < 128 or w == 8]
    if tall:
        out += [gemv.GemvConfig(bn, bk, sk, 4, st) for bn, bk, sk, st in
                itertools.product((8, 16, 32), (128, 256, 512), (1, 2, 4), (3, 5)) if (bn, sk) != (16, 1)
                and (bn, sk) != (32, 1)]
    return out


def section_gemv(args: argparse.Namespace, dev: str, dtype: torch.dtype) -> dict[str, Any]:
    """Per shape and M: cuBLAS vs every config; returns the best config per (shape, M)."""
    best: dict[str, Any] = {}
    shapes = SMOKE if args.smoke else LLAMA_8B
    for (name, (n, k)), m in itertools.product(shapes.items(), [int(r) for r in args.gemv_rows.split(",")]):
        if args.gemv_shapes and name not in args.gemv_shapes.split(","):
            continue
        if time.time() - T0 > args.budget_s:
            emit(section="gemv", skipped=f"{name} m{m}: budget")
            continue
        ws = [torch.randn(n, k, device=dev, dtype=dtype) / k**0.5 for _ in range(COPIES)]
        x = torch.randn(m, k, device=dev, dtype=dtype)
        ref = F.linear(x, ws[0])
        nbytes = n * k * ws[0].element_size()

        def cublas() -> None:
            for w in ws:
                F.linear(x, w)

        us = timed_us(cublas, args.smoke)
        rows = [emit(section="gemv", shape=name, m=m, impl="cublas", us=us, GBps=nbytes / us / 1e3)]
        # the registered config first, timed once even where the sweep holds it too
        for cfg in dict.fromkeys([gemv.config_for(n, k), *gemv_configs(args.smoke, tall=k > 2 * n)]):
            try:
                err = rel(gemv.gemv(x, ws[0], config=cfg), ref)
                us = timed_us(lambda cfg=cfg: [gemv.gemv(x, w, config=cfg) for w in ws], args.smoke)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                emit(section="gemv", shape=name, m=m, cfg=cfg.__dict__, error=f"{type(exc).__name__}: {exc}"[:200])
                continue
            rows.append(emit(section="gemv", shape=name, m=m, impl="triton", cfg=cfg.__dict__, us=us,
                             GBps=nbytes / us / 1e3, err=err))
        ok = [r for r in rows if r["impl"] == "triton" and r["err"] < 2e-2]
        if ok and not args.smoke:
            top = min(ok, key=lambda r: r["us"])
            best[f"{name} m{m}"] = {"cublas_us": rows[0]["us"], "best_us": top["us"], "cfg": top["cfg"],
                                    "GBps": top["GBps"], "cublas_GBps": rows[0]["GBps"]}
        del ws
        torch.cuda.empty_cache() if dev == "cuda" else None
    return best


def section_chain(args: argparse.Namespace, dev: str, dtype: torch.dtype, best: dict[str, Any]) -> None:
    """A whole Llama-3.1-8B batch-1 step without its attention (32 layers + lm_head, distinct weights), the
    figure the batch-1 target depends on: the GEMVs alone through cuBLAS and through the best config per shape;
    then with the layer's small ops between them (two residual-add norms, SiLU-and-mul), as the model runs them:
    the difference is what fusing them away could gain at most."""
    from appliance.kernels.triton import activation, norm

    layers = 2 if args.smoke else 32
    shapes = SMOKE if args.smoke else LLAMA_8B
    per_layer = ("qkv", "o", "gate_up", "down")
    ws = {s: [torch.randn(*shapes[s], device=dev, dtype=dtype) / shapes[s][1] ** 0.5 for _ in range(layers)]
          for s in per_layer}
    gs = [torch.randn(shapes["qkv"][1], device=dev, dtype=dtype) * 0.1 + 1 for _ in range(2 * layers)]
    head = torch.randn(*shapes["lm_head"], device=dev, dtype=dtype) * 0.01
    total = sum(w.numel() * w.element_size() for v in ws.values() for w in v) + head.numel() * head.element_size()
    hidden, inter = shapes["o"][0], shapes["down"][1]
    for m in (1, 8):
        x0 = torch.randn(m, hidden, device=dev, dtype=dtype)

        def config(s: str) -> gemv.GemvConfig:
            cfg = best.get(f"{s} m{m}", {}).get("cfg")
            return gemv.GemvConfig(**cfg) if cfg else gemv.config_for(*shapes[s])

        def layer(i: int, impl: str, h: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            w = {s: ws[s][i] for s in per_layer}

            def mm(a: torch.Tensor, s: str) -> torch.Tensor:
                return F.linear(a, w[s]) if impl == "cublas" else gemv.gemv(a, w[s], config=config(s))

            small = impl == "triton+small"
            h, res = norm.rms_norm(h, gs[2 * i], 1e-5, res) if small else (h, res)
            o = mm(mm(h, "qkv")[:, :hidden], "o")
            h, res = norm.rms_norm(o, gs[2 * i + 1], 1e-5, res) if small else (o, res)
            gu = mm(h, "gate_up")
            return mm(activation.silu_and_mul(gu) if small else gu[:, :inter], "down"), res

        def run(impl: str) -> torch.Tensor:
            h, res = x0, torch.zeros_like(x0)
            for i in range(layers):
                h, res = layer(i, impl, h, res)
            if impl == "cublas":
                return F.linear(h, head)
            return gemv.gemv(h, head, config=config("lm_head"))

        emit(section="chain_check", m=m, impl="triton", err=rel(run("triton"), run("cublas")))
        for impl in ("cublas", "triton", "triton+small"):
            us = timed_us(lambda impl=impl: run(impl), args.smoke) * COPIES
            emit(section="chain", m=m, impl=impl, ms=us / 1e3, GB=total / 1e9, GBps=total / us / 1e3,
                 configs=f"swept best for {sorted(best)}, else gemv.config_for")


def ragged_lens(b: int, lo: int, hi: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(b)]


def decode_case(lens: list[int], heads: int, hkv: int, width_tokens: int, dev: str, dtype: torch.dtype,
                page: int = 16, copies: int = COPIES, head_major: bool = False, d: int = 128) -> tuple[Any, ...]:
    """q, `copies` (k, v) caches as [blocks, page, hkv, d] views (head-major ones stored [blocks, hkv, page, d]
    underneath), a block table of width_tokens holding every sequence's blocks in random order, seq_lens, and
    the KV bytes one call reads."""
    blocks = sum(-(-n // page) for n in lens) + 1

    def cache() -> torch.Tensor:
        if head_major:
            return torch.randn(blocks, hkv, page, d, device=dev, dtype=dtype).transpose(1, 2)
        return torch.randn(blocks, page, hkv, d, device=dev, dtype=dtype)

    caches = [(cache(), cache()) for _ in range(copies)]
    perm = torch.randperm(blocks)
    table = torch.zeros(len(lens), width_tokens // page, dtype=torch.int32)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // page)
        table[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    q = torch.randn(len(lens), heads, d, device=dev, dtype=dtype)
    seq = torch.tensor(lens, dtype=torch.int32, device=dev)
    kv_bytes = sum(lens) * hkv * d * 2 * torch.empty(0, dtype=dtype).element_size()
    return q, caches, table.to(dev), seq, kv_bytes


def decode_cases(smoke: bool, only: str = "") -> dict[str, tuple[list[int], int, int, int]]:
    """name -> (seq_lens, q heads, kv heads, table width in tokens): the batches the decode sections time (and
    tools/lab_memory.py); `only`: a comma list of fragments of the names to keep."""
    if smoke:
        return {"smoke ragged": (ragged_lens(4, 5, 60, 0), 4, 2, 64)}
    cases = {
        "llama b1 kv1024 (w2048)": ([1024], 32, 8, 2048),
        "qwen b256 uniform 540 (w1024)": ([540] * 256, 16, 8, 1024),
        "qwen b256 ragged 100-2048 (w2048)": (ragged_lens(256, 100, 2048, 0), 16, 8, 2048),
        "llama b200 ragged 1024-2048 (w2048)": (ragged_lens(200, 1024, 2048, 1), 32, 8, 2048),
        # a wave of the 8B 1000-prompt run: 212 sequences admitted 8 per step, so within 26 tokens of each other
        "llama b212 wave 1536-1562 (w2048)": (ragged_lens(212, 1536, 1562, 2), 32, 8, 2048),
        "llama b212 wave 1100-1126 (w2048)": (ragged_lens(212, 1100, 1126, 3), 32, 8, 2048),
    }
    # the shrinking batches of the Qwen3 throughput run: fewer sequences, as ragged
    cases.update({f"qwen b{b} ragged 100-2048 (w2048)": (ragged_lens(b, 100, 2048, b), 16, 8, 2048)
                  for b in (16, 32, 64, 96, 128)})
    if only:
        cases = {k: v for k, v in cases.items() if any(f in k for f in only.split(","))}
    return cases


def row_order(seq: torch.Tensor, name: str) -> torch.Tensor | None:
    """The decode kernel's row order: rows (None), longest first, or zigzag (longest, shortest, second longest,
    second shortest ...: long and short programs side by side throughout the launch)."""
    if name == "rows":
        return None
    desc = torch.argsort(seq, descending=True)
    if name == "longest":
        return desc
    n = desc.shape[0]
    pick = torch.arange(n, device=seq.device)
    pick = torch.where(pick % 2 == 0, pick // 2, n - 1 - pick // 2)
    return desc[pick]


def section_decode(args: argparse.Namespace, dev: str, dtype: torch.dtype) -> None:
    from appliance.kernels.reference.attention import decode_attention as ref_decode

    cases = decode_cases(args.smoke, args.decode_cases)
    if args.smoke:
        knobs = [(16, 4, 2, s) for s in (None, 2)]
    else:
        knobs = list(itertools.product((32, 64, 128), (4, 8), (2, 3), (None, 1, 2, 4, 8, 16, 32)))
        if args.decode_knobs:  # BLOCK_N:warps:stages:splits, comma-separated ("-" splits: the heuristic)
            knobs = [(int(b), int(w), int(st), None if sp == "-" else int(sp))
                     for b, w, st, sp in (k.split(":") for k in args.decode_knobs.split(","))]
        elif args.decode_splits_only:  # the tuned tile, every split factor
            knobs = [(decode.BLOCK_N_UNSPLIT if s in (None, 1) else decode.BLOCK_N, decode.NUM_WARPS,
                      decode.NUM_STAGES, s) for s in (None, 1, 2, 4, 8, 16, 32)]
    pages = [int(x) for x in args.decode_pages.split(",")]
    if len(pages) > 1 or args.decode_order:  # the registered kernel as it is, over pages (cache.block_size)
        knobs = [(None, None, None, None)]
    orders = ("rows", "longest", "zigzag") if args.decode_order or args.smoke else ("rows",)
    saved = (decode.BLOCK_N, decode.BLOCK_N_UNSPLIT, decode.NUM_WARPS, decode.NUM_STAGES)
    for (name, (lens, h, hkv, width)), page in itertools.product(cases.items(), pages):
        q, caches, table, seq, kv_bytes = decode_case(lens, h, hkv, width, dev, dtype, page=page)
        ref = ref_decode(q, caches[0][0], caches[0][1], table, seq, 128**-0.5)
        for (bn, w, st, splits), order_name in itertools.product(knobs, orders):
            order = row_order(seq, order_name)
            if time.time() - T0 > args.budget_s:
                emit(section="decode", skipped=f"{name}: budget")
                break
            if splits is not None and splits * bn > width:
                continue
            if bn is not None:
                decode.BLOCK_N, decode.BLOCK_N_UNSPLIT, decode.NUM_WARPS, decode.NUM_STAGES = bn, bn, w, st
            try:
                err = rel(decode.decode_attention(q, caches[0][0], caches[0][1], table, seq, 128**-0.5, splits,
                                                  order), ref)
                us = timed_us(lambda s=splits, o=order: [decode.decode_attention(q, k, v, table, seq, 128**-0.5, s, o)
                                                         for k, v in caches], args.smoke)
            except Exception as exc:  # noqa: BLE001
                emit(section="decode", case=name, knobs=[bn, w, st, splits], error=f"{type(exc).__name__}: {exc}"[:200])
                continue
            emit(section="decode", case=name, page=page, block_n=bn, warps=w, stages=st, splits=splits,
                 order=order_name, us=us, GBps=kv_bytes / us / 1e3, err=err)
        del caches
    decode.BLOCK_N, decode.BLOCK_N_UNSPLIT, decode.NUM_WARPS, decode.NUM_STAGES = saved


def unfused_prologue(positions: torch.Tensor, qkv: torch.Tensor, h: int, hkv: int, d: int, cos_sin: torch.Tensor,
                     qw: torch.Tensor | None, kw: torch.Tensor | None, caches: tuple[torch.Tensor, torch.Tensor],
                     slots: torch.Tensor) -> torch.Tensor:
    """What LlamaAttention ran before the fused op, kernel for kernel: split views of the qkv output, rms_norm on
    each (it copies the strided views), rope, store_kv."""
    t = qkv.shape[0]
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k = q.reshape(t, h, d), k.reshape(t, hkv, d)
    if qw is not None and kw is not None:
        norm = get_op("rms_norm", "triton")
        q, k = norm(q, qw, 1e-6), norm(k, kw, 1e-6)
    q, k = get_op("rope", "triton")(positions, q, k, cos_sin, True)
    get_op("store_kv", "triton")(k, v.view(t, hkv, d), *caches, slots)
    return q


def rope_store_case(args: argparse.Namespace, name: str, t: int, dev: str, dtype: torch.dtype) -> None:
    h, hkv, d, qk_norm = ({"smoke": (4, 2, 64, True), "smoke-nonorm": (4, 2, 64, False)} if args.smoke
                          else PROLOGUE)[name]
    fused = get_op("rope_store_kv", "triton")
    page, blocks = 16, (4 if args.smoke else 2048)
    width = (h + 2 * hkv) * d
    qkvs = [torch.randn(t, width, device=dev, dtype=dtype) for _ in range(COPIES)]
    caches = [(torch.randn(blocks, page, hkv, d, device=dev, dtype=dtype),
               torch.randn(blocks, page, hkv, d, device=dev, dtype=dtype)) for _ in range(COPIES)]
    slots = torch.randperm(blocks * page, device=dev)[:t]
    positions = torch.randint(0, 4096, (t,), device=dev)
    cos_sin = cos_sin_cache(d, 4096, 1e6).to(dev)
    qw, kw = ((1 + 0.1 * torch.randn(d, device=dev)).to(dtype) if qk_norm else None for _ in range(2))

    def run_fused(i: int) -> torch.Tensor:
        return fused(positions, qkvs[i], h, hkv, d, cos_sin, True, qw, kw, 1e-6, *caches[i], slots)

    def run_unfused(i: int) -> torch.Tensor:
        return unfused_prologue(positions, qkvs[i], h, hkv, d, cos_sin, qw, kw, caches[i], slots)

    want_q = run_unfused(0)
    stored = caches[0][0].view(-1, hkv, d)  # [slots, Hkv, D]
    want_k = stored[slots].clone()
    stored[slots] = 0  # the fused op must write them again
    err = max(rel(run_fused(0), want_q), rel(stored[slots], want_k))
    nbytes = (2 * h + 4 * hkv) * d * t * qkvs[0].element_size()  # q, k, v read; q, k, v written
    for impl, fn in (("unfused", run_unfused), ("fused", run_fused)):
        us = timed_us(lambda fn=fn: [fn(i) for i in range(COPIES)], args.smoke)
        emit(section="rope_store", shape=name, t=t, impl=impl, us=us, GBps=nbytes / us / 1e3, err=err)


def section_rope_store(args: argparse.Namespace, dev: str, dtype: torch.dtype) -> None:
    """Per model shape and row count: the unfused chain (2 or 5 launches, plus the copies) vs `rope_store_kv`
    (one launch)."""
    names = ("smoke", "smoke-nonorm") if args.smoke else tuple(PROLOGUE)
    for name, t in itertools.product(names, (1, 5) if args.smoke else (1, 256)):
        if time.time() - T0 > args.budget_s:
            emit(section="rope_store", skipped=f"{name} t{t}: budget")
            continue
        rope_store_case(args, name, t, dev, dtype)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="gemv,chain,decode,rope_store")
    ap.add_argument("--budget-s", type=float, default=400.0)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--gemv-shapes", default="", help="comma list of LLAMA_8B shapes to sweep (default: all)")
    ap.add_argument("--gemv-rows", default="1,8,16", help="comma list of row counts the GEMV sweep times")
    ap.add_argument("--decode-cases", default="", help="comma list of fragments of decode case names to run")
    ap.add_argument("--decode-splits-only", action="store_true", help="decode: only the split factor varies")
    ap.add_argument("--decode-knobs", default="", help="decode: BLOCK_N:warps:stages:splits,... to time ('-' splits: "
                    "the heuristic's) instead of the full grid")
    ap.add_argument("--decode-order", action="store_true",
                    help="decode: the registered kernel taking the rows in order, longest first, and zigzag")
    ap.add_argument("--decode-pages", default="16",
                    help="decode: cache page sizes; several time the registered kernel as it is at each")
    args = ap.parse_args()
    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    torch.manual_seed(0)
    only = set(args.only.split(","))
    best = section_gemv(args, dev, dtype) if "gemv" in only else {}
    if best:
        emit(section="gemv_best", best=best)
    if "chain" in only:
        section_chain(args, dev, dtype, best)
    if "decode" in only:
        section_decode(args, dev, dtype)
    if "rope_store" in only:
        section_rope_store(args, dev, dtype)
    emit(section="done", elapsed_s=round(time.time() - T0, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
