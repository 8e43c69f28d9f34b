"""The FP8 GEMV of decode batches (kernels/triton/fp8_gemv.py): against the torch reference under the interpreter
(selfcheck_fp8_gemv), its sm_90 build without a GPU, and on a GPU the Llama-3.1-8B shapes plus the selection by M
inside scaled_linear (the layers' one entry): up to 16 rows take the GEMV, more take cuBLASLt.

Run: python -m pytest -q -p no:cacheprovider tests/test_fp8_gemv.py
"""
from __future__ import annotations

import pytest
import torch
from selfcheck_runner import interpreted_cases

from appliance.kernels.fp8_gemm import FP8, FP8_MAX, fp8_gemv, quantize_activation, scaled_mm_reference
from appliance.kernels.triton.selfcheck_fp8_gemv import gpu_cases, run_case, small_cases


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreted_cases("appliance.kernels.triton.selfcheck_fp8_gemv", timeout=600)


@pytest.mark.parametrize("case", [c.name for c in small_cases()])
def test_fp8_gemv_matches_reference_interpreted(interpreted: dict[str, dict], case: str) -> None:
    row = interpreted.get(case)
    assert row is not None, f"{case} printed no result"
    assert "error" not in row, row.get("error")
    assert row["err"] <= row["tol"], row


def test_reference_is_the_quantized_product() -> None:
    """The torch op is quantize-then-multiply: equal to the two steps, and within fp8 rounding of the float
    product (both factors carry e4m3's 2^-4 relative step)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=g), torch.randn(32, 64, generator=g) * 0.1
    scale = w.abs().amax(dim=1) / FP8_MAX
    wq = (w / scale[:, None]).to(FP8)
    xq, xs = quantize_activation(x, None)
    assert torch.equal(fp8_gemv(x, wq, scale, None), scaled_mm_reference(xq, xs, wq, scale, x.dtype))
    rel = (fp8_gemv(x, wq, scale, None) - x @ w.t()).norm() / (x @ w.t()).norm()
    assert 0 < rel < 0.08, rel


def test_fp8_gemv_compiles_for_hopper() -> None:
    """The GEMV kernel (the weight stream over x quantized ahead) builds for sm_90 with fp8 x fp8 tl.dot."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from appliance.kernels.triton import fp8_gemv as mod

    if not isinstance(mod._fp8_stream_kernel, triton.runtime.JITFunction):
        pytest.skip("this process imported the kernels under TRITON_INTERPRET")
    types = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32", "bias_ptr": "*bf16",
             "y_ptr": "*bf16"}
    const = {"BIAS": True, "BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 256, "UPCAST": False, "GDC": False}
    fn = mod._fp8_stream_kernel
    sig = {a: "constexpr" if a in const else types.get(a, "i32") for a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    assert kernel.asm["cubin"]
    assert "e4m3.e4m3" in kernel.asm["ptx"]  # the MMA takes the fp8 tiles as they are


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", gpu_cases(), ids=lambda c: c.name)
def test_gpu_fp8_gemv_matches_reference(case: object) -> None:
    import appliance.kernels.triton  # noqa: F401  (registers the ops)

    row = run_case(case, "cuda")  # type: ignore[arg-type]
    assert row["err"] <= row["tol"], row


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_scaled_linear_selects_the_gemv_by_rows() -> None:
    """scaled_linear gives the GEMV's result bit for bit at M <= 16 and the cuBLASLt one above; both within
    bf16 rounding of the float32 reference."""
    from appliance.kernels.fp8_gemm import scaled_linear
    from appliance.kernels.triton.fp8_gemv import fp8_gemv as triton_fp8_gemv

    g = torch.Generator().manual_seed(0)
    w = torch.randn(4096, 4096, generator=g) * 0.02
    scale = w.abs().amax(dim=1) / FP8_MAX
    wq, scale = (w / scale[:, None]).to(FP8).cuda(), scale.cuda()
    for m in (1, 16, 17):
        x = torch.randn(m, 4096, generator=g).to("cuda", torch.bfloat16)
        got = scaled_linear(x, wq, scale, None)
        if m <= 16:
            assert torch.equal(got, triton_fp8_gemv(x, wq, scale, None))
        ref = fp8_gemv(x.cpu(), wq.cpu(), scale.cpu(), None).float()
        assert (got.float().cpu() - ref).norm() / ref.norm() < 1e-2, m
