"""The Triton fused MoE (16-bit, fp8 and MXFP4 experts) against the torch reference on random shapes; one JSON
line per case.

    TRITON_INTERPRET=1 python -m appliance.kernels.moe.selfcheck cpu     # small shapes, CPU interpreter
    python -m appliance.kernels.moe.selfcheck cuda                       # realistic shapes on a GPU
"""
from __future__ import annotations

import json
import math
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    hidden: int
    inter: int
    experts: int
    top_k: int
    dtype: torch.dtype
    fp8_block: tuple[int, int] | None = None
    tol: float = 2e-3
    gpt_oss: bool = False  # expert biases and the clamped SwiGLU
    fp8_rows: bool = False  # fp8 weights with one scale per output row (per-tensor / per-channel checkpoints)
    mxfp4: bool = False  # MXFP4 experts (op fused_moe_mxfp4): random codes and random scales


def small_cases() -> list[Case]:
    return [
        Case("one_token", 1, 64, 32, 4, 2, torch.float32),
        Case("ragged", 37, 96, 80, 8, 3, torch.float32),  # sizes off the tile grid, experts unhit
        Case("prefill_tiles", 70, 64, 48, 2, 2, torch.float32),  # > 16 rows per expert: the prefill tiles
        Case("bf16", 20, 64, 64, 6, 2, torch.bfloat16, tol=3e-2),
        Case("fp8_blocks", 19, 64, 64, 4, 2, torch.float32, fp8_block=(32, 32), tol=2e-3),
        Case("fp8_fine_blocks", 11, 64, 48, 4, 2, torch.float32, fp8_block=(16, 16), tol=2e-3),  # tiles shrink
        Case("fp8_rows", 23, 64, 48, 4, 2, torch.float32, fp8_rows=True),
        Case("fp8_rows_bf16_prefill_tiles", 70, 96, 80, 4, 2, torch.bfloat16, fp8_rows=True, tol=3e-2),
        Case("gpt_oss_bias_clamp", 13, 64, 48, 8, 4, torch.float32, gpt_oss=True),
        Case("gpt_oss_prefill_bf16", 70, 64, 32, 4, 4, torch.bfloat16, gpt_oss=True, tol=3e-2),
        # MXFP4: every code and a spread of scales; steps of two groups, and of one where hidden is 3 groups
        Case("mxfp4_one_token", 1, 64, 32, 4, 2, torch.float32, gpt_oss=True, mxfp4=True, tol=1e-5),
        Case("mxfp4_ragged", 13, 96, 64, 8, 4, torch.float32, gpt_oss=True, mxfp4=True, tol=1e-5),
        Case("mxfp4_prefill_tiles", 70, 64, 96, 2, 2, torch.float32, mxfp4=True, tol=1e-5),
        # 16-bit activations take tl.dot_scaled: prefill and decode tiles, bf16 and fp16 (tolerances under the
        # error of one scale group off by a factor of 2)
        Case("mxfp4_bf16", 70, 64, 32, 4, 4, torch.bfloat16, gpt_oss=True, mxfp4=True, tol=1e-2),
        Case("mxfp4_bf16_decode", 5, 96, 64, 8, 4, torch.bfloat16, gpt_oss=True, mxfp4=True, tol=1e-2),
        Case("mxfp4_fp16", 9, 64, 96, 4, 2, torch.float16, mxfp4=True, tol=3e-3),
    ]


def gpu_cases() -> list[Case]:
    return [
        Case("qwen3_30b_decode", 64, 2048, 768, 128, 8, torch.bfloat16, tol=3e-2),
        Case("deepseek_v3_fp8_batch1", 1, 7168, 2048, 32, 8, torch.bfloat16, fp8_block=(128, 128), tol=3e-2),
        Case("qwen3_30b_fp8_rows_decode", 64, 2048, 768, 128, 8, torch.bfloat16, fp8_rows=True, tol=3e-2),
        Case("qwen3_30b_fp8_rows_prefill", 2048, 2048, 768, 128, 8, torch.bfloat16, fp8_rows=True, tol=3e-2),
        Case("deepseek_v2_lite_prefill", 2048, 2048, 1408, 64, 6, torch.bfloat16, tol=3e-2),
        Case("deepseek_v3_fp8", 256, 7168, 2048, 32, 8, torch.bfloat16, fp8_block=(128, 128), tol=3e-2),
        Case("gpt_oss_20b_decode", 1, 2880, 2880, 32, 4, torch.bfloat16, gpt_oss=True, tol=3e-2),
        Case("gpt_oss_20b_batch256", 256, 2880, 2880, 32, 4, torch.bfloat16, gpt_oss=True, tol=3e-2),
        Case("gpt_oss_20b_mxfp4_decode", 1, 2880, 2880, 32, 4, torch.bfloat16, gpt_oss=True, mxfp4=True, tol=2e-2),
        Case("gpt_oss_20b_mxfp4_batch32", 32, 2880, 2880, 32, 4, torch.bfloat16, gpt_oss=True, mxfp4=True,
             tol=2e-2),
        Case("gpt_oss_120b_mxfp4_prefill", 2048, 2880, 2880, 128, 4, torch.bfloat16, gpt_oss=True, mxfp4=True,
             tol=2e-2),
        Case("gpt_oss_20b_mxfp4_float32", 16, 2880, 2880, 32, 4, torch.float32, gpt_oss=True, mxfp4=True, tol=1e-4),
    ]


def run_case(case: Case, device: str) -> dict[str, object]:
    from appliance.kernels import (
        moe,  # noqa: F401
        registry,
    )
    from appliance.kernels.moe.reference import block_quantize, row_quantize

    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    x = torch.randn(case.tokens, case.hidden, generator=gen)
    w13 = torch.randn(case.experts, 2 * case.inter, case.hidden, generator=gen) / case.hidden**0.5
    w2 = torch.randn(case.experts, case.hidden, case.inter, generator=gen) / case.inter**0.5
    logits = torch.randn(case.tokens, case.experts, generator=gen)
    weights, ids = logits.softmax(-1).topk(case.top_k, dim=-1)
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if case.fp8_block is not None:
        (w13, s13), (w2, s2) = block_quantize(w13, case.fp8_block), block_quantize(w2, case.fp8_block)
        scales = (s13.to(device), s2.to(device))
    elif case.fp8_rows:
        (w13, s13), (w2, s2) = row_quantize(w13), row_quantize(w2)
        scales = (s13.to(device), s2.to(device))
    else:
        w13, w2 = w13.to(case.dtype), w2.to(case.dtype)
    args = (x.to(case.dtype).to(device), w13.to(device), w2.to(device), weights.to(device), ids.to(device))
    extra: dict[str, object] = {}
    if case.gpt_oss:  # limit 1: the random pre-activations (about unit scale) cross it on both sides
        extra = {"w13_bias": torch.randn(case.experts, 2 * case.inter, generator=gen).to(case.dtype).to(device),
                 "w2_bias": torch.randn(case.experts, case.hidden, generator=gen).to(case.dtype).to(device),
                 "swiglu_limit": 1.0, "swiglu_alpha": 1.702}
    if case.mxfp4:
        experts = random_mxfp4(case, gen)
        args = (args[0], *(t.to(device) for t in experts), *args[3:])
        ref = registry.get("fused_moe_mxfp4", "torch")(*args, **extra).float()
        got = registry.get("fused_moe_mxfp4", "triton")(*args, **extra).float()
    else:
        ref = registry.get("fused_moe", "torch")(*args, *scales, case.fp8_block, **extra).float()
        got = registry.get("fused_moe", "triton")(*args, *scales, case.fp8_block, **extra).float()
    err = ((got - ref).norm() / ref.norm().clamp(min=1e-6)).item()
    return {"op": "fused_moe_mxfp4" if case.mxfp4 else "fused_moe", "case": case.name, "err": err, "tol": case.tol}


def random_mxfp4(case: Case, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """(w13_blocks, w13_scales, w2_blocks, w2_scales): uniformly random bytes (every e2m1 code, both signs) and
    scales spread over 2^-3 .. 2^2 around 1 / (6 sqrt(K)), so each output sums K terms of unit-scale size."""
    out: list[torch.Tensor] = []
    for n, k in ((2 * case.inter, case.hidden), (case.hidden, case.inter)):
        blocks = torch.randint(0, 256, (case.experts, n, k // 2), generator=gen, dtype=torch.uint8)
        centre = 127 - round(math.log2(6 * k**0.5))
        scales = torch.randint(centre - 3, centre + 3, (case.experts, n, k // 32), generator=gen).to(torch.uint8)
        out += [blocks, scales]
    return tuple(out)


@dataclass(frozen=True)
class GemmCase:
    name: str
    m: int
    n: int
    k: int
    dtype: torch.dtype
    block: tuple[int, int]
    tol: float = 2e-3


def small_gemm_cases() -> list[GemmCase]:
    return [GemmCase("fp8_gemm_ragged", 5, 72, 96, torch.float32, (32, 32)),
            GemmCase("fp8_gemm_bf16", 17, 64, 64, torch.bfloat16, (32, 32), tol=3e-2),
            GemmCase("fp8_gemm_fine_blocks", 3, 48, 80, torch.float32, (16, 16))]


def gpu_gemm_cases() -> list[GemmCase]:
    return [GemmCase("fp8_gemm_v3_q_b", 256, 24576, 1536, torch.bfloat16, (128, 128), tol=3e-2),
            GemmCase("fp8_gemm_v3_o", 7, 7168, 16384, torch.bfloat16, (128, 128), tol=3e-2)]


def run_gemm_case(case: GemmCase, device: str) -> dict[str, object]:
    from appliance.kernels import (
        moe,  # noqa: F401
        registry,
    )
    from appliance.kernels.moe.reference import block_quantize

    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    x = torch.randn(case.m, case.k, generator=gen).to(case.dtype).to(device)
    w, s = block_quantize(torch.randn(case.n, case.k, generator=gen), case.block)
    args = (x, w.to(device), s.to(device), case.block)
    ref = registry.get("fp8_block_matmul", "torch")(*args).float()
    got = registry.get("fp8_block_matmul", "triton")(*args).float()
    err = ((got - ref).norm() / ref.norm().clamp(min=1e-6)).item()
    return {"op": "fp8_block_matmul", "case": case.name, "err": err, "tol": case.tol}


def run(cases: list[Case | GemmCase], device: str) -> Iterator[dict[str, object]]:
    for case in cases:
        op = ("fused_moe_mxfp4" if case.mxfp4 else "fused_moe") if isinstance(case, Case) else "fp8_block_matmul"
        try:
            yield run_case(case, device) if isinstance(case, Case) else run_gemm_case(case, device)
        except Exception as exc:  # noqa: BLE001 - report every case, the test names the failure
            yield {"op": op, "case": case.name, "error": f"{type(exc).__name__}: {exc}"}


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    cases: list[Case | GemmCase] = ([*small_cases(), *small_gemm_cases()] if where == "cpu"
                                    else [*gpu_cases(), *gpu_gemm_cases()])
    for row in run(cases, where):
        print(json.dumps(row), flush=True)
