"""The fp8 KV cache paths of the Triton ops against the torch reference, on random inputs.

Every op that writes or reads the paged cache (store_kv, rope_store_kv, gemv_normed_rope_store, decode_attention,
prefill_attention) runs with an e4m3 or e5m2 cache and random per-kv-head scales; the attention ops also with a
sliding window and sinks (gpt-oss's layers). The 16-bit inputs come from the selfcheck builders
(selfcheck_attention.py, selfcheck.py); their caches are quantized with the same scales, and a few inputs are
outliers far above the format's range (the stores must saturate, never write NaN). store_kv must agree with the
reference bit for bit (on the GPU a float32 division may differ in the last place: STORE_TOL allows one entry in
1000 to be a step off).
The fused stores round k to bf16 first, which the CPU interpreter does by truncation (kernels/triton/rope_store.py),
so in bf16 their caches may differ by one fp8 step here and there: bounded by half a step of relative error over the
whole cache (HALF_STEP); in fp16 they are exact too. Attention outputs are within selfcheck_case.TOL.

`python -m appliance.kernels.triton.selfcheck_fp8 cpu|gpu`: one JSON line per case (the CPU tests run it under
TRITON_INTERPRET=1; `gpu` runs realistic_cases, Llama-3.1-8B shapes).
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from appliance.kernels.reference.kv_quant import FP8_MAX, quantize
from appliance.kernels.registry import get
from appliance.kernels.triton.selfcheck import rope_store_inputs
from appliance.kernels.triton.selfcheck_attention import (
    decode_inputs,
    prefill_inputs,
    store_kv_inputs,
)
from appliance.kernels.triton.selfcheck_case import TOL, Inputs, rel_err
from appliance.kernels.triton.selfcheck_chain import chain_args, op_args

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# where each op's caches sit among its positional args
CACHE_ARGS = {"store_kv": (2, 3), "decode_attention": (1, 2), "prefill_attention": (1, 2),
              "rope_store_kv": (10, 11), "gemv_normed_rope_store": (10, 11)}
# the stores' outputs: at most this share of cache entries may differ by one fp8 step on a GPU (float32 division)
STORE_TOL = {"cpu": 0.0, "cuda": 1e-3}
HALF_STEP = {E4M3: 2.0**-4, E5M2: 2.0**-3}  # half an fp8 step, relative (3 and 2 mantissa bits)


def _scales(hkv: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head scales between 1/64 and 1/4: values of order one land mid-range, outliers past the max."""
    gen = torch.Generator().manual_seed(seed + 17)
    k, v = (torch.exp2(-2.0 - 4.0 * torch.rand(hkv, generator=gen)).to(device) for _ in range(2))
    return k, v


def fp8_inputs(base: Inputs, op: str, dtype: torch.dtype, outliers: bool = True) -> tuple[tuple[Any, ...],
                                                                                          dict[str, Any]]:
    """`base`'s args with fp8 caches (its 16-bit caches quantized with random per-head scales) and the scales as
    keyword args; with `outliers`, a few inputs the stores write are scaled far past the format's max."""
    args = list(base.args)
    ki, vi = CACHE_ARGS[op]
    hkv = args[ki].shape[2]
    ks, vs = _scales(hkv, str(args[ki].device), hkv)
    args[ki], args[vi] = quantize(args[ki], ks, dtype), quantize(args[vi], vs, dtype)
    if outliers and op == "store_kv":
        for i in (0, 1):
            args[i] = args[i].clone()
            args[i].view(-1)[::53] *= 4 * FP8_MAX[dtype]
    if outliers and op in ("rope_store_kv", "gemv_normed_rope_store"):
        src = 1 if op == "rope_store_kv" else 0
        args[src] = args[src].clone()
        args[src].view(-1)[::41] *= 1000.0
    return tuple(args), {"k_scale": ks, "v_scale": vs}


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def _store_err(fast: torch.Tensor, ref: torch.Tensor) -> float:
    """The share of cache entries that differ (NaN anywhere counts as all)."""
    if torch.isnan(fast.float()).any():
        return 1.0
    return float((fast.float() != ref.float()).float().mean())


def compare_fp8(op: str, args: tuple[Any, ...], kwargs: dict[str, Any], fast_kwargs: dict[str, Any],
                device: str) -> tuple[float, float]:
    """(error, bound): stores by the share of differing cache entries, outputs by selfcheck.rel_err."""
    a, r = tuple(_clone(x) for x in args), tuple(_clone(x) for x in args)
    out = get(op, "triton")(*a, **kwargs, **fast_kwargs)
    want = get(op, "torch")(*r, **kwargs)
    store_tol = STORE_TOL["cuda" if device != "cpu" else "cpu"]
    if op == "fp8_quant_act":  # the same scales (float32 ops in one order), then the same e4m3 values
        if not rel_err(out[1], want[1]) <= 1e-6:
            return float("inf"), store_tol
        return _store_err(out[0], want[0]), store_tol
    ki, vi = CACHE_ARGS[op]
    if op == "store_kv":
        return max(_store_err(a[ki], r[ki]), _store_err(a[vi], r[vi])), store_tol
    dtype = args[1].dtype if op == "rope_store_kv" else args[0].dtype
    if op in ("rope_store_kv", "gemv_normed_rope_store"):
        if dtype == torch.bfloat16:
            cache_err, cache_tol = max(rel_err(a[ki], r[ki]), rel_err(a[vi], r[vi])), HALF_STEP[args[ki].dtype]
        else:
            cache_err, cache_tol = max(_store_err(a[ki], r[ki]), _store_err(a[vi], r[vi])), store_tol
        if torch.isnan(a[ki].float()).any() or torch.isnan(a[vi].float()).any():
            cache_err = float("inf")
        # one number against 1: q's error over its bound, the caches' over theirs (a zero bound: any difference)
        return max(rel_err(out, want) / TOL[dtype], cache_err / cache_tol if cache_tol else cache_err * 1e30), 1.0
    return rel_err(out, want), TOL[dtype]


Case = tuple[str, str, Callable[[], tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]]]


def _case(op: str, base: Callable[[], Inputs], dtype: torch.dtype) -> Callable[[], Any]:
    def build() -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
        inputs = base()
        args, kwargs = fp8_inputs(inputs, op, dtype)
        return args, {**kwargs, **dict(inputs.kwargs)}, dict(inputs.fast_kwargs)  # + sliding_window / sinks
    return build


def act_inputs(rows: int, k: int, dtype: torch.dtype, device: str, static: bool) -> Callable[[], Any]:
    """Rows of x with an outlier channel (40x) and one all-zero row; a static scale that saturates the outliers."""
    def build() -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
        gen = torch.Generator().manual_seed(rows + k)
        x = torch.randn(rows, k, generator=gen)
        x[:, 3] *= 40
        x[-1] = 0
        scale = torch.tensor([float(x.abs().max()) / 4 / FP8_MAX[E4M3]], device=device) if static else None
        return (x.to(dtype).to(device), scale), {}, {}
    return build


def _chain(m: int, hidden: int, nq: int, nkv: int, d: int, dtype: torch.dtype, device: str) -> Inputs:
    x = chain_args(m, hidden, 2 * hidden, nq, nkv, d, dtype, False, dtype, device)
    return Inputs(op_args("gemv_normed_rope_store", x), 0)


def small_cases(device: str = "cpu") -> list[Case]:
    bf, f16 = torch.bfloat16, torch.float16
    d = device
    cases: list[Case] = []
    for fp8, name in ((E4M3, "e4m3"), (E5M2, "e5m2")):
        cases += [
            ("store_kv", f"{name}-bf16-saturating", _case("store_kv", lambda: store_kv_inputs(20, 2, 64, 16, bf, d),
                                                           fp8)),
            ("decode_attention", f"{name}-bf16-gqa4-direct", _case("decode_attention", lambda: decode_inputs(
                3, 8, 2, 64, 16, [1, 37, 100], bf, d, num_splits=1), fp8)),
            ("decode_attention", f"{name}-f16-split3", _case("decode_attention", lambda: decode_inputs(
                3, 4, 2, 64, 16, [300, 1, 130], f16, d, num_splits=3), fp8)),
            ("decode_attention", f"{name}-bf16-one-tile-splits", _case("decode_attention", lambda: decode_inputs(
                4, 4, 2, 64, 16, [0, 65, 64, 130], bf, d, num_splits=3), fp8)),
            ("prefill_attention", f"{name}-bf16-prefix", _case("prefill_attention", lambda: prefill_inputs(
                [5, 1, 70], [0, 20, 33], 4, 2, 64, 16, bf, d), fp8)),
            ("decode_attention", f"{name}-bf16-window70-sinks-split3", _case("decode_attention", lambda: decode_inputs(
                3, 4, 2, 64, 16, [300, 1, 130], bf, d, num_splits=3, sliding_window=70, sinks=True), fp8)),
            ("prefill_attention", f"{name}-bf16-window10-sinks-prefix", _case("prefill_attention", lambda: (
                prefill_inputs([5, 1, 70], [0, 20, 33], 4, 2, 64, 16, bf, d, sliding_window=10, sinks=True)), fp8)),
            ("rope_store_kv", f"{name}-bf16-qknorm-saturating", _case("rope_store_kv", lambda: rope_store_inputs(
                6, 4, 2, 64, 64, True, True, bf, d, 4), fp8)),
            ("gemv_normed_rope_store", f"{name}-f16-m5-saturating", _case(
                "gemv_normed_rope_store", lambda: _chain(5, 96, 2, 1, 64, f16, d), fp8)),
        ]
    cases += [("fp8_quant_act", "bf16-dynamic-outlier-k1500", act_inputs(5, 1500, bf, d, False)),
              ("fp8_quant_act", "f16-static-saturating", act_inputs(3, 200, f16, d, True))]
    return cases


def realistic_cases(device: str = "cuda") -> list[Case]:
    """Llama-3.1-8B shapes (32 q / 8 kv heads, head_dim 128), bf16 activations, e4m3 caches."""
    bf, d = torch.bfloat16, device
    g = torch.Generator().manual_seed(3)
    lens = torch.randint(1, 1025, (64,), generator=g).tolist()
    return [
        ("store_kv", "e4m3-t1000", _case("store_kv", lambda: store_kv_inputs(1000, 8, 128, 16, bf, d), E4M3)),
        ("decode_attention", "e4m3-b1-ctx4096", _case("decode_attention", lambda: decode_inputs(
            1, 32, 8, 128, 16, [4096], bf, d), E4M3)),
        ("decode_attention", "e4m3-b64-ctx1024", _case("decode_attention", lambda: decode_inputs(
            64, 32, 8, 128, 16, lens, bf, d), E4M3)),
        ("prefill_attention", "e4m3-prefix", _case("prefill_attention", lambda: prefill_inputs(
            [512, 1, 300, 77], [512, 1000, 0, 3], 32, 8, 128, 16, bf, d), E4M3)),
        ("rope_store_kv", "e4m3-llama-t300", _case("rope_store_kv", lambda: rope_store_inputs(
            300, 32, 8, 128, 128, True, False, bf, d, 16), E4M3)),
        ("gemv_normed_rope_store", "e4m3-llama-8b-m1", _case(
            "gemv_normed_rope_store", lambda: _chain(1, 4096, 32, 8, 128, bf, d), E4M3)),
        ("fp8_quant_act", "bf16-dynamic-t1000-k14336", act_inputs(1000, 14336, bf, d, False)),
        ("fp8_quant_act", "bf16-static-t64-k4096", act_inputs(64, 4096, bf, d, True)),
    ]


def main() -> None:
    import appliance.kernels.triton  # noqa: F401  (registers the ops)

    device = {"gpu": "cuda"}.get(sys.argv[1], sys.argv[1]) if len(sys.argv) > 1 else "cpu"
    cases = small_cases(device) if device == "cpu" else realistic_cases(device)
    for op, case, build in cases:
        try:
            args, kwargs, fast_kwargs = build()
            err, tol = compare_fp8(op, args, kwargs, fast_kwargs, device)
            print(json.dumps({"op": op, "case": case, "err": err, "tol": tol}), flush=True)
        except Exception as exc:  # noqa: BLE001  (one failing case must not hide the others)
            print(json.dumps({"op": op, "case": case, "error": f"{type(exc).__name__}: {exc}"}), flush=True)


if __name__ == "__main__":
    main()
