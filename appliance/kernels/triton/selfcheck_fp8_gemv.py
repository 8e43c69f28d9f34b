"""The Triton FP8 GEMV (kernels/triton/fp8_gemv.py) against the torch reference (kernels/fp8_gemm.py: per-token
or static activation quantization, then the quantized product in float32) on random inputs with an outlier
activation column; one JSON line per case.

    TRITON_INTERPRET=1 python -m appliance.kernels.triton.selfcheck_fp8_gemv cpu   # small shapes, interpreter
    python -m appliance.kernels.triton.selfcheck_fp8_gemv cuda                      # Llama-3.1-8B shapes
"""
from __future__ import annotations

import json
import sys
import zlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Case:
    name: str
    m: int
    n: int
    k: int
    dtype: torch.dtype
    static: bool = False
    bias: bool = False
    tol: float = 1e-5  # relative error norm; 16-bit outputs round to their own step
    # x handed over as a QuantizedAct (quantized by the torch reference), which both ops use as it is, instead
    # of act_quant.py's launch first
    producer: bool = False


def small_cases() -> list[Case]:
    return [
        Case("m1_dynamic_f32", 1, 48, 96, torch.float32),
        Case("m3_ragged_f32", 3, 72, 200, torch.float32),  # N and K off the tile grid
        Case("m16_static_bias_f32", 16, 40, 64, torch.float32, static=True, bias=True),
        Case("m1_bf16_tall", 1, 32, 160, torch.bfloat16, tol=1e-2),  # K > 2N: the tall tiles
        Case("m5_static_f16", 5, 64, 128, torch.float16, static=True, tol=2e-3),
        Case("m3_ragged_bias_f32_producer", 3, 72, 200, torch.float32, bias=True, producer=True),
    ]


def gpu_cases() -> list[Case]:  # Llama-3.1-8B's projections at batch 1 and 16
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
    return [Case(f"llama8b_{name}_m{m}", m, n, k, torch.bfloat16, tol=1e-2)
            for name, (n, k) in shapes.items() for m in (1, 16)] + [
        Case("llama8b_qkv_m1_static", 1, 6144, 4096, torch.bfloat16, static=True, tol=1e-2)] + [
        Case(f"llama8b_{name}_m{m}_producer", m, n, k, torch.bfloat16, tol=1e-2, producer=True)
        for name, (n, k) in shapes.items() for m in (1, 16)]


def run_case(case: Case, device: str) -> dict[str, object]:
    from appliance.kernels import registry
    from appliance.kernels.fp8_gemm import FP8_MAX
    from appliance.kernels.triton.fp8_gemv import config_for

    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    x = torch.randn(case.m, case.k, generator=gen)
    x[:, 3] *= 50  # an outlier channel: the per-token scale follows it, a static scale clips it
    w = torch.randn(case.n, case.k, generator=gen) * 0.05
    amax = w.abs().amax(dim=1)
    scale = amax / FP8_MAX
    wq = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    input_scale = torch.tensor([20.0 / FP8_MAX]) if case.static else None
    bias = torch.randn(case.n, generator=gen) if case.bias else None
    to = {"device": device}
    args = (x.to(case.dtype).to(**to), wq.to(**to), scale.to(**to), None if input_scale is None
            else input_scale.to(**to), None if bias is None else bias.to(case.dtype).to(**to))
    if case.producer:
        from appliance.kernels.fp8_act import quantized

        args = (quantized(args[0]), *args[1:])
    ref = registry.get("fp8_gemv", "torch")(*args).float()
    got = registry.get("fp8_gemv", "triton")(*args, config=config_for(case.n, case.k)).float()
    err = ((got - ref).norm() / ref.norm().clamp(min=1e-6)).item()
    return {"op": "fp8_gemv", "case": case.name, "err": err, "tol": case.tol}


if __name__ == "__main__":
    where = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    for case in small_cases() if where == "cpu" else gpu_cases():
        try:
            row = run_case(case, where)
        except Exception as exc:  # noqa: BLE001 - report every case, the test names the failure
            row = {"op": "fp8_gemv", "case": case.name, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(row), flush=True)
