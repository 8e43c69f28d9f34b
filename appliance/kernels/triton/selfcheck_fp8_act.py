"""The producers that write an FP8 linear's input quantized (ops rms_norm_quant, silu_and_mul_quant: a norm or
SiLU-and-mul and act_quant.py's per-token quantization in one launch), on random inputs with an outlier channel
and an all-zero row; one JSON line per case, two measures each:

- `exact`: the share of e4m3 values (and of scales, and of the residual sums) that differ from the Triton ops the
  kernel replaces, run one after the other (rms_norm or silu_and_mul, then fp8_quant_act): the same math in the
  same order, so none may differ on the CPU (STORE_TOL allows a GPU's float32 division a stray step);
- `err`: the dequantized output's relative error against the torch reference (the 16-bit torch op, then
  quantize_activation), whose 16-bit rounding differs from the kernels' in places (bf16 by up to a step, which
  can move the e4m3 value a step): within TOL.

    TRITON_INTERPRET=1 python -m appliance.kernels.triton.selfcheck_fp8_act cpu   # small shapes, interpreter
    python -m appliance.kernels.triton.selfcheck_fp8_act cuda                      # Llama-3.1-8B shapes
"""
from __future__ import annotations

import json
import sys
import zlib
from dataclasses import dataclass

import torch

from appliance.kernels.fp8_gemm import QuantizedAct

# dequantized relative error against the torch reference: a 16-bit step moves an e4m3 value by at most one step
# (2^-3 relative) where it crosses a rounding boundary; the CPU interpreter rounds to bf16 by truncation
# (kernels/triton/rope_store.py), a step off in up to half the values, which moves ~6% of the e4m3 values here
# (measured 0.016-0.019). A wrong scale or a garbled row is off by order one.
TOL = {torch.float32: 1e-3, torch.float16: 5e-3, torch.bfloat16: 4e-2}
STORE_TOL = {"cpu": 0.0, "cuda": 1e-3}


@dataclass(frozen=True)
class Case:
    name: str
    op: str  # rms_norm_quant / silu_and_mul_quant
    rows: int
    width: int  # the norm's hidden size; SiLU-and-mul's intermediate size (its input is twice as wide)
    dtype: torch.dtype
    residual: bool = False


def small_cases() -> list[Case]:
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    return [
        Case("norm_bf16_ragged", "rms_norm_quant", 5, 200, bf),
        Case("norm_residual_bf16", "rms_norm_quant", 4, 256, bf, residual=True),
        Case("norm_residual_f16", "rms_norm_quant", 3, 96, f16, residual=True),
        Case("norm_f32", "rms_norm_quant", 2, 64, f32),
        Case("silu_bf16_one_pass", "silu_and_mul_quant", 5, 300, bf),
        Case("silu_f16_one_pass", "silu_and_mul_quant", 3, 1024, f16),
        Case("silu_bf16_two_pass", "silu_and_mul_quant", 2, 16400, bf),  # wider than activation.ROW_BLOCK
    ]


def gpu_cases() -> list[Case]:  # Llama-3.1-8B: hidden 4096, intermediate 14336; decode batches and a prefill
    bf = torch.bfloat16
    return [Case(f"norm_residual_m{m}", "rms_norm_quant", m, 4096, bf, residual=True) for m in (1, 16, 1000)] + [
        Case("norm_m1", "rms_norm_quant", 1, 4096, bf)] + [
        Case(f"silu_m{m}", "silu_and_mul_quant", m, 14336, bf) for m in (1, 16, 1000)] + [
        Case("silu_m4_two_pass", "silu_and_mul_quant", 4, 28672, bf)]  # Llama-3.1-70B's at tp 1


def _inputs(case: Case, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    width = case.width if case.op == "rms_norm_quant" else 2 * case.width
    x = torch.randn(case.rows, width, generator=gen)
    x[:, 3] *= 40  # an outlier channel: the per-token scale follows it
    if case.rows > 1:
        x[-1] = 0  # an all-zero row: MIN_SCALE, zeros, no NaN
    to = {"device": device, "dtype": case.dtype}
    if case.op == "silu_and_mul_quant":
        return (x.to(**to),)
    w = 0.5 + torch.rand(case.width, generator=gen)
    if not case.residual:
        return x.to(**to), w.to(**to)
    return x.to(**to), w.to(**to), torch.randn(case.rows, case.width, generator=gen).to(**to)


def _run(op: str, backend: str, args: tuple[torch.Tensor, ...]) -> tuple[QuantizedAct, torch.Tensor | None]:
    from appliance.kernels.registry import get

    if op == "rms_norm_quant":
        out = get(op, backend)(args[0], args[1], 1e-6, *args[2:])
        return out if len(args) == 3 else (out, None)
    return get(op, backend)(*args), None


def _unfused(op: str, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The Triton producer, then act_quant.py's launch: (e4m3, scales, residual sum)."""
    from appliance.kernels.registry import get

    if op == "rms_norm_quant":
        out = get("rms_norm", "triton")(args[0], args[1], 1e-6, *args[2:])
        y, summed = out if len(args) == 3 else (out, None)
    else:
        y, summed = get("silu_and_mul", "triton")(*args), None
    q, s = get("fp8_quant_act", "triton")(y.reshape(-1, y.shape[-1]), None)
    return q, s, summed


def _share(a: torch.Tensor, b: torch.Tensor) -> float:
    if torch.isnan(a.float()).any():
        return 1.0
    a8, b8 = (t.contiguous().view(torch.uint8) if t.element_size() == 1 else t for t in (a, b))
    return float((a8 != b8).float().mean())


def run_case(case: Case, device: str) -> dict[str, object]:
    from appliance.kernels.triton.selfcheck_case import rel_err

    args = _inputs(case, device)
    got, summed = _run(case.op, "triton", args)
    q, s, want_sum = _unfused(case.op, args)
    exact = max(_share(got.xq.reshape(q.shape), q), _share(got.scale, s),
                _share(summed, want_sum) if summed is not None and want_sum is not None else 0.0)
    ref, _ = _run(case.op, "torch", args)
    deq = got.xq.float() * got.scale.reshape(*got.xq.shape[:-1], 1)
    ref_deq = ref.xq.float() * ref.scale.reshape(*ref.xq.shape[:-1], 1)
    assert got.dtype == case.dtype and got.xq.shape == ref.xq.shape and got.scale.shape == (case.rows, 1)
    return {"op": case.op, "case": case.name, "exact": exact, "exact_tol": STORE_TOL[device],
            "err": rel_err(deq, ref_deq), "tol": TOL[case.dtype]}


if __name__ == "__main__":
    import appliance.kernels.triton  # noqa: F401  (registers the ops)

    where = {"gpu": "cuda"}.get(sys.argv[1], sys.argv[1]) if len(sys.argv) > 1 else "cpu"
    for case in small_cases() if where == "cpu" else gpu_cases():
        try:
            row = run_case(case, where)
        except Exception as exc:  # noqa: BLE001 - report every case, the test names the failure
            row = {"op": case.op, "case": case.name, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(row), flush=True)
