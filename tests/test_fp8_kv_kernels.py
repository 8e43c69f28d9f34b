"""The fp8 KV cache's kernels: saturating quantization, every fp8 kernel path against the torch reference under
the Triton interpreter, every kernel's fp8 variant compiled for sm_90 without a GPU, and Llama-3.1-8B shapes on a
GPU. The memory plan, scales and model-level accuracy: test_fp8_kv_cache.py.

Run: python -m pytest -q -p no:cacheprovider tests/test_fp8_kv_kernels.py
"""
from __future__ import annotations

import pytest
import torch
from selfcheck_runner import interpreted_rows

from appliance.kernels.reference.kv_quant import FP8_MAX, quantize
from appliance.kernels.triton.selfcheck_fp8 import (
    compare_fp8,
    realistic_cases,
    small_cases,
)

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# ---- numbers -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantize_saturates_instead_of_nan(dtype: torch.dtype) -> None:
    x = torch.randn(64, 2, 8) * 3
    x[0, 0, :4] = torch.tensor([1e6, -1e6, 2 * FP8_MAX[dtype], float(FP8_MAX[dtype]) * 1.01])
    scale = torch.tensor([1.0, 0.5])
    q = quantize(x, scale, dtype)
    assert torch.isfinite(q.float()).all()
    assert q[0, 0, :4].float().tolist() == [FP8_MAX[dtype], -FP8_MAX[dtype], FP8_MAX[dtype], FP8_MAX[dtype]]
    back = q.float() * scale[:, None]
    inside = x[1:].abs() < 100  # round trip of in-range values: within half an fp8 step (2^-4 e4m3, 2^-3 e5m2)
    rel = ((back[1:] - x[1:]).abs() / x[1:].abs().clamp_min(2.0**-6))[inside]
    assert rel.max() <= (2.0**-4 if dtype == E4M3 else 2.0**-3) + 1e-6


# ---- kernels under the interpreter ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def interpreted() -> dict[tuple[str, str], dict]:
    rows = interpreted_rows("appliance.kernels.triton.selfcheck_fp8", timeout=600)
    return {(r["op"], r["case"]): r for r in rows}


@pytest.mark.parametrize("op,case", [(op, case) for op, case, _ in small_cases()])
def test_fp8_kernel_matches_reference(interpreted: dict[tuple[str, str], dict], op: str, case: str) -> None:
    row = interpreted.get((op, case))
    assert row is not None, f"{op}/{case} printed no result"
    assert "error" not in row, row.get("error")
    assert row["err"] <= row["tol"], row


# ---- the GPU build, without a GPU ----------------------------------------------------------------------------
@pytest.mark.parametrize("fp8,fp8_max", [("fp8e4nv", 448.0), ("fp8e5", 57344.0)])
def test_fp8_kernels_compile_for_hopper(fp8: str, fp8_max: float) -> None:
    """Triton compiles every kernel's fp8 variant for sm_90 (MLA's too), and the activation quantizer (the interpreter
    accepts what the compiler does not, such as a name bound to two types in the branches of a runtime if)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from appliance.kernels.mla import triton_mla, triton_prefill
    from appliance.kernels.triton import act_quant, cache, decode, prefill, rope_store

    if not isinstance(decode._decode_kernel, triton.runtime.JITFunction):
        pytest.skip("this process imported the kernels under TRITON_INTERPRET")
    types = {"k_ptr": f"*{fp8}", "v_ptr": f"*{fp8}", "k_cache_ptr": f"*{fp8}", "v_cache_ptr": f"*{fp8}",
             "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32",
             "bt_ptr": "*i32", "lens_ptr": "*i32", "order_ptr": "*i64", "cu_q_ptr": "*i32", "cu_tiles_ptr": "*i32",
             "slot_ptr": "*i64", "pos_ptr": "*i64", "cache_ptr": "*fp32", "qk_scale": "fp32", "eps": "fp32",
             "kv_scale_ptr": "*fp32", "slots_ptr": "*i64", "scale": "fp32", "tree_mask_ptr": "*i64",
             "tree_width_ptr": "*i32"}
    fp = {"KV_FP8": True, "FP8_MAX": fp8_max}
    mla = {"R": 512, "DR": 64, "BLOCK_R": 512, "BLOCK_DR": 64, "BLOCK_SIZE": 64, "BLOCK_N": 32, "UPCAST": False, **fp}
    heads = {"GROUP": 4, "BLOCK_H": 16, "D": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16, "ORDERED": True, "UPCAST": False,
             "GDC": False, **fp}
    builds = [
        (cache._store_kv_kernel, {"HKV": 8, "D": 128, "BLOCK_H": 8, "BLOCK_D": 128, "BLOCK_SIZE": 16, **fp}),
        (decode._decode_kernel, {**heads, "BLOCK_N": 64, "DIRECT": False}),
        (decode._decode_kernel, {**heads, "BLOCK_N": 128, "DIRECT": True}),
        (decode._decode_tile_kernel, {**heads, "BLOCK_N": 64}),
        *((prefill._prefill_kernel, {"GROUP": 4, "D": 128, "BLOCK_D": 128, "BLOCK_SIZE": 16, "BLOCK_M": 64,
                                     "BLOCK_N": 64, "LOG_SEQS": 3, "UPCAST": False, "TREE": tree, **fp})
          for tree in (False, True)),  # a draft tree's verification reads an fp8 cache too
        (rope_store._rope_store_kernel, {"NQ": 32, "NKV": 8, "HALF": 64, "D": 128, "BLOCK_SIZE": 16, "BLOCK_H": 16,
                                         "BLOCK_HALF": 64, "BLOCK_TAIL": 1, "BLOCK_D": 128, "IS_NEOX": True,
                                         "HAS_NORM": True, "GDC": False, **fp}),
        (triton_mla._store_kernel, {"WIDTH": 576, "BLOCK_W": 1024, **fp}),
        (triton_mla._mla_decode_kernel, {**mla, "BLOCK_H": 16}),
        (triton_prefill._mla_prefill_kernel, {**mla, "BLOCK_M": 16, "LOG_SEQS": 3}),
        (act_quant._quant_rows, {"MIN_AMAX": 448e-12, "FP8_MAX": 448.0, "STATIC": False, "BLOCK": 1024}),
        (act_quant._quant_rows, {"MIN_AMAX": 448e-12, "FP8_MAX": 448.0, "STATIC": True, "BLOCK": 1024}),
    ]
    for fn, const in builds:
        own = ({"q_ptr": "*fp8e4nv", "s_ptr": "*fp32", "static_ptr": "*fp32"} if fn is act_quant._quant_rows
               else {"cache_ptr": f"*{fp8}"} if "kv_scale_ptr" in fn.arg_names else {})
        sig = {a: "constexpr" if a in const else {**types, **own}.get(a, "*bf16" if a.endswith("_ptr") else "i32")
               for a in fn.arg_names}
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
        assert kernel.asm["cubin"], fn


# ---- on a GPU ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op,case", [(op, case) for op, case, _ in realistic_cases("cuda")])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_kernels_match_reference(op: str, case: str) -> None:
    """Llama-3.1-8B shapes, e4m3 caches, on the GPU (selfcheck_fp8.realistic_cases)."""
    import appliance.kernels.triton  # noqa: F401  (registers the ops)

    build = next(b for o, c, b in realistic_cases("cuda") if (o, c) == (op, case))
    args, kwargs, fast_kwargs = build()
    err, tol = compare_fp8(op, args, kwargs, fast_kwargs, "cuda")
    assert err <= tol, (op, case, err, tol)
