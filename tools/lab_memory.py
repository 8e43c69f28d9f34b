#!/usr/bin/env python3
"""Memory-system experiments for decode attention on one GPU: the read-only bandwidth ceiling (what a kernel
that only reads can reach, against the copy figure the targets use) and the KV cache's layout (page-major as
stored vs head-major, the same kernel through strides).

    python3 tools/lab_memory.py [--only read,layout] [--budget-s 300]
    TRITON_INTERPRET=1 python3 tools/lab_memory.py --smoke      # tiny shapes on the CPU: checks the script

Prints one JSON line per measurement. Timing: a CUDA graph of the callable, replayed; median of 5 batches of
replays, per replay.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import triton
import triton.language as tl

from appliance.kernels.triton import decode
# tools/ is on sys.path when this runs as a script
from kernel_lab import COPIES, decode_case, decode_cases, emit, timed_us  # noqa: E402

BF16 = torch.bfloat16

T0 = time.time()


def graph_ms(fn: Callable[[], Any], smoke: bool) -> float:
    """Median ms per call replayed from a CUDA graph (kernel_lab's timing, without its per-copy division)."""
    return timed_us(fn, smoke) * COPIES / 1e3


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0, cache_modifier=".cg")
    tl.store(out_ptr + tl.program_id(0), tl.sum(v.to(tl.float32), 0))


def section_read(args: argparse.Namespace, dev: str) -> None:
    """Bytes read once per call, nothing written but one float per program: the read-only ceiling."""
    n = (1 << 16) if args.smoke else (1 << 30)  # 2 GiB of bf16
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    for block, warps in ((4096, 4), (8192, 8), (16384, 8), (32768, 16)):
        out = torch.empty(triton.cdiv(n, block), device=dev, dtype=torch.float32)
        ms = graph_ms(lambda: _read_kernel[(triton.cdiv(n, block),)](x, out, n, BLOCK=block, num_warps=warps),
                      args.smoke)
        emit(section="read", impl=f"triton block {block} warps {warps}", ms=ms, GBps=2 * n / ms / 1e6)
    y = torch.empty_like(x)
    ms = graph_ms(lambda: y.copy_(x), args.smoke)
    emit(section="read", impl="copy (read + write counted)", ms=ms, GBps=4 * n / ms / 1e6)
    ms = graph_ms(lambda: x.sum(), args.smoke)
    emit(section="read", impl="torch sum", ms=ms, GBps=2 * n / ms / 1e6)


def section_layout(args: argparse.Namespace, dev: str) -> None:
    """The decode cases of kernel_lab with the cache stored page-major (as allocated) and head-major."""
    copies = 1 if args.smoke else 3
    cases = decode_cases(args.smoke, "qwen b256 ragged,llama b200,qwen b64,llama b1")
    for name, (lens, h, hkv, width) in cases.items():
        q, caches, table, seq, nbytes = decode_case(lens, h, hkv, width, dev, BF16, copies=copies)
        head_major = decode_case(lens, h, hkv, width, dev, BF16, copies=copies, head_major=True)[1]
        for (k, v), (k0, v0) in zip(head_major, caches):  # the same values, stored head-major
            k.copy_(k0)
            v.copy_(v0)
        ref = decode.decode_attention(q, caches[0][0], caches[0][1], table, seq, 128**-0.5)
        for layout, cs in (("page-major", caches), ("head-major", head_major)):
            if time.time() - T0 > args.budget_s:
                return
            err = float((decode.decode_attention(q, cs[0][0], cs[0][1], table, seq, 128**-0.5).float()
                         - ref.float()).abs().max())
            ms = graph_ms(lambda cs=cs: [decode.decode_attention(q, k, v, table, seq, 128**-0.5) for k, v in cs],
                          args.smoke) / copies
            emit(section="layout", case=name, layout=layout, us=ms * 1e3, GBps=nbytes / ms / 1e6, max_err=err)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="read,layout")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    dev = "cpu" if args.smoke and not torch.cuda.is_available() else "cuda"
    only = set(args.only.split(","))
    emit(section="device", name=torch.cuda.get_device_name() if dev == "cuda" else "cpu")
    for name, fn in (("read", section_read), ("layout", section_layout)):
        if name in only:
            fn(args, dev)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
