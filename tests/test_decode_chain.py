"""The fused decode chain's kernels (kernels/triton/gemv_chain.py) against their torch references on random
inputs, and the references against the unfused ops they stand for.

The Triton kernels run on the CPU under TRITON_INTERPRET=1 in a subprocess (this file run as a script prints one
JSON row per case); `@pytest.mark.gpu` runs the same cases and a Llama-8B-sized one in-process. Errors are the
largest |fast - reference| over the largest |reference| of each output ("scaled error"); the interpreter rounds
float32 -> bfloat16 by truncation, so bf16 gets a few ulps on the CPU.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from appliance.kernels.registry import get
from appliance.kernels.triton.selfcheck_chain import chain_args

bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
# name -> (rows, hidden, inter, heads, kv heads, head_dim, dtype, qkv bias, cache dtype)
CASES: dict[str, tuple[Any, ...]] = {
    "b1-bf16": (1, 64, 96, 4, 2, 64, bf, False, bf),
    "b5-f16-bias": (5, 96, 160, 2, 1, 64, f16, True, f16),
    "b16-f32-d128": (16, 64, 64, 2, 2, 128, f32, False, f32),
    "b3-f16-f32cache": (3, 64, 96, 4, 2, 64, f16, False, f32),
}
CPU_LIMIT = {f32: 1e-5, f16: 2e-3, bf: 3e-2}  # bf16: the interpreter truncates
GPU_LIMIT = {f16: 2e-3, bf: 1e-2}


def scaled_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def chain_inputs(spec: tuple[Any, ...], device: str, seed: int = 0) -> dict[str, Any]:
    return chain_args(*spec, device, seed)


def run_case(spec: tuple[Any, ...], device: str, seed: int = 0) -> dict[str, Any]:
    """Every chain op on the Triton backend and the reference, same inputs; what the tests assert on."""
    x = chain_inputs(spec, device, seed)
    row: dict[str, Any] = {}
    prep = {b: get("norm_prep", b)(x["h"], x["g"]) for b in ("triton", "torch")}
    row["prep_xs"] = scaled_error(prep["triton"][0], prep["torch"][0])
    row["prep_sumsq"] = scaled_error(prep["triton"][1].sum(1), prep["torch"][1].sum(1))
    xs, parts = x["xs"], x["partials"]
    caches = {b: (x["k_cache"].clone(), x["v_cache"].clone()) for b in prep}
    q = {b: get("gemv_normed_rope_store", b)(xs, x["w_qkv"], x["b_qkv"], parts, x["eps"], x["positions"], x["nq"],
                                             x["nkv"], x["d"], x["cos_sin"], *caches[b], x["slots"]) for b in prep}
    flat = {b: [c.view(-1, x["nkv"], x["d"]) for c in caches[b]] for b in prep}
    slots = x["slots"]
    written = torch.zeros(flat["torch"][0].shape[0], dtype=torch.bool, device=device)
    written[slots[slots >= 0]] = True
    row["q_shape"] = list(q["triton"].shape)
    row["q"] = scaled_error(q["triton"], q["torch"])
    row["k"] = scaled_error(flat["triton"][0][written], flat["torch"][0][written])
    row["v"] = scaled_error(flat["triton"][1][written], flat["torch"][1][written])
    row["untouched_equal"] = all(torch.equal(flat["triton"][i][~written], c.view(-1, x["nkv"], x["d"])[~written])
                                 for i, c in enumerate((x["k_cache"], x["v_cache"])))
    row["written_changed"] = bool((flat["triton"][0][written] != x["k_cache"].view_as(flat["torch"][0])[written]).any())
    silu = {b: get("gemv_normed_silu", b)(xs, x["w_gu"], parts, x["eps"]) for b in prep}
    row["silu"] = scaled_error(silu["triton"], silu["torch"])
    res = {b: x["h"].clone() for b in prep}
    out = {b: get("gemv_residual", b)(x["act"], x["w_down"], res[b], x["g"]) for b in prep}
    row["residual"] = scaled_error(res["triton"], res["torch"])
    row["residual_xs"] = scaled_error(out["triton"][0], out["torch"][0])
    row["residual_sumsq"] = scaled_error(out["triton"][1].sum(1), out["torch"][1].sum(1))
    bare = x["h"].clone()
    row["no_norm_returns_none"] = get("gemv_residual", "triton")(x["act"], x["w_down"], bare, None) is None
    row["no_norm_residual"] = scaled_error(bare, res["torch"])
    return row


def main() -> None:
    """Under TRITON_INTERPRET=1: one JSON row per case."""
    from tests.selfcheck_runner import print_case_rows

    print_case_rows(CASES, run_case)


def check_row(row: dict[str, Any], spec: tuple[Any, ...], limits: dict[torch.dtype, float]) -> None:
    m, nq, d, dtype = spec[0], spec[3], spec[5], spec[6]
    assert "error" not in row, row.get("error")
    assert row["q_shape"] == [m, nq, d]
    for key in ("prep_xs", "prep_sumsq", "q", "k", "v", "silu", "residual", "residual_xs", "residual_sumsq",
                "no_norm_residual"):
        assert row[key] <= limits[dtype], (key, row)
    assert row["untouched_equal"], "slots not in slot_mapping (and padding rows) must stay as they were"
    assert row["written_changed"] and row["no_norm_returns_none"]


# ------------------------------------------------------------------------------------------------ CPU, interpreted
@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    pytest.importorskip("triton")
    from selfcheck_runner import interpreted_cases

    return interpreted_cases("tests.test_decode_chain", timeout=300)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernels_match_reference(interpreted: dict[str, dict[str, Any]], name: str) -> None:
    assert name in interpreted, f"case {name} produced no result"
    check_row(interpreted[name], CASES[name], CPU_LIMIT)


def test_references_are_the_unfused_layer_to_one_rounding() -> None:
    """The split RMSNorm (producer: h * g and sum h^2; consumer: scale by rsqrt(mean + eps)) gives the unfused
    norm -> linear to float32 accuracy, and gemv_residual's residual is F.linear + add, bit for bit."""
    x = chain_inputs((3, 64, 96, 4, 2, 64, f32, True, f32), "cpu", seed=1)
    xs, parts = get("norm_prep", "torch")(x["h"], x["g"])
    normed = get("rms_norm", "torch")(x["h"], x["g"], x["eps"])
    gu = F.linear(normed, x["w_gu"])
    silu = get("gemv_normed_silu", "torch")(xs, x["w_gu"], parts, x["eps"])
    assert scaled_error(silu, get("silu_and_mul", "torch")(gu)) < 1e-5
    res = x["h"].clone()
    out = get("gemv_residual", "torch")(x["act"], x["w_down"], res, x["g"])
    assert out is not None
    assert torch.equal(res, x["h"] + F.linear(x["act"], x["w_down"]))
    assert torch.allclose(out[1].sum(1), res.pow(2).sum(1)) and torch.equal(out[0], res * x["g"])


def test_bad_arguments_raise_clear_errors() -> None:
    pytest.importorskip("triton")
    from appliance.kernels.triton import gemv_chain

    w = torch.zeros(8, 64)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        gemv_chain.gemv_residual(torch.zeros(17, 64), w, torch.zeros(17, 8), None)
    with pytest.raises(ValueError, match="residual"):
        gemv_chain.gemv_residual(torch.zeros(2, 64), w, torch.zeros(2, 9), None)
    with pytest.raises(ValueError, match="partials"):
        gemv_chain.gemv_normed_silu(torch.zeros(2, 64), torch.zeros(16, 64), torch.ones(3, 1), 1e-6)
    cache = torch.zeros(2, 4, 1, 48)
    with pytest.raises(ValueError, match="head_dim 48"):
        gemv_chain.gemv_normed_rope_store(torch.zeros(1, 64), torch.zeros(192, 64), None, torch.ones(1, 1), 1e-6,
                                          torch.zeros(1, dtype=torch.long), 2, 1, 48, torch.zeros(8, 48), cache,
                                          cache, torch.zeros(1, dtype=torch.long))


def test_kernels_compile_for_hopper() -> None:
    """Triton compiles every chain kernel for sm_90 without a GPU, with programmatic dependent launch, each
    LAUNCH_NEXT: the interpreter accepts things the compiler does not
    (globals that are not constexpr, a name bound to two types in the branches of an if)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from appliance.kernels.triton import gemv_chain as G

    if not isinstance(G._residual_kernel, triton.runtime.JITFunction):
        pytest.skip("this process imported the kernels under TRITON_INTERPRET")
    types = {"part_ptr": "*fp32", "cs_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64", "eps": "fp32"}
    tiles = {"BLOCK_N": 64, "BLOCK_K": 128, "BLOCK_P": 64, "UPCAST": False, "GDC": True}
    builds = [(G._norm_prep_kernel, {"BLOCK_N": 1024, "GDC": True}),
              (G._residual_kernel, {**tiles, "PREP": True}),
              (G._silu_kernel, tiles),
              (G._rope_store_kernel, {"NQ": 32, "NKV": 8, "D": 128, "BLOCK_SIZE": 16, "BLOCK_K": 128, "BLOCK_P": 64,
                                      "HAS_BIAS": True, "UPCAST": False, "GDC": True})]
    for fn, consts in builds:
        for nxt in (0, 1, 2) if "NEXT" in fn.arg_names else (None,):
            const = {k: v for k, v in {**consts, "NEXT": nxt}.items() if k in fn.arg_names}
            sig = {a: "constexpr" if a in const else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
                   for a in fn.arg_names}
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                    target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 6})
            assert kernel.asm["cubin"], (fn, nxt)


# ------------------------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", [n for n, spec in CASES.items() if spec[6] != f32] + ["llama-8b-b8"])
def test_gpu_kernels_match_reference(name: str) -> None:
    """Half precision only: the chain serves no float32 model on a kernel backend (decode_chain.unserved_reason)."""
    spec = CASES.get(name, (8, 4096, 14336, 32, 8, 128, bf, False, bf))
    check_row(run_case(spec, "cuda"), spec, GPU_LIMIT)


if __name__ == "__main__":
    main()
