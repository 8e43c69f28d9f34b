"""The skinny GEMM (kernels/triton/skinny_gemm.py) against F.linear in fp32, its argument checks, its table of
measured winners, its routing in layers.linear.matmul (17..256 rows), and tools/lab_gemm.py's harness.

CPU: the kernel runs under TRITON_INTERPRET=1 in a subprocess (this file run as a script prints one JSON row per
case; the variable must be set before triton is imported, which this process has done), and compiles for sm_90
in-process (PDL, the prefetch and both orientations: the first GPU run is not a compile-error hunt). GPU
(@pytest.mark.gpu): Qwen3-0.6B / Llama-3.1-8B decode shapes, eager and replayed from a CUDA graph with PDL.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

bf, f16 = torch.bfloat16, torch.float16
# name -> (m, n, k, dtype, bias, SkinnyGemmConfig kwargs or None for config_for[, x row padding: x a column slice
# of a wider tensor, as the qkv split gives]); n and k not multiples of the blocks
CASES: dict[str, tuple[Any, ...]] = {
    "m17-bf16-default": (17, 50, 70, bf, False, None),
    "m17-f16-bias-default": (17, 96, 64, f16, True, None),
    "m40-bf16-bias-prefetch2-wleft": (40, 70, 200, bf, True, {"block_m": 32, "block_n": 16, "block_k": 32,
                                                                "prefetch": 2, "w_left": True}),
    "m40-f16-prefetch1": (40, 33, 100, f16, False, {"block_m": 16, "block_n": 32, "block_k": 32, "prefetch": 1}),
    "m130-bf16-prefetch2": (130, 45, 96, bf, False, {"block_m": 64, "block_n": 16, "block_k": 32, "prefetch": 2}),
    "m130-f16-bias-wleft": (130, 100, 72, f16, True, {"block_m": 32, "block_n": 32, "block_k": 16, "w_left": True}),
    "m130-bf16-wleft-prefetch1-short-k": (130, 40, 24, bf, True, {"block_m": 64, "block_n": 32, "block_k": 16,
                                                                  "prefetch": 1, "w_left": True}),
    "m256-f16-prefetch2-k-one-tile": (256, 24, 40, f16, False, {"block_m": 128, "block_n": 16, "block_k": 64,
                                                                 "prefetch": 2}),
    "m33-bf16-bias-strided-x": (33, 48, 80, bf, True, {"block_m": 32, "block_n": 16, "block_k": 32, "prefetch": 1,
                                                       "w_left": True}, 24),
}
# max |out - ref| over max |ref|: the output is rounded once to its dtype (the interpreter truncates to bf16)
TOL = {bf: 2e-2, f16: 2e-3}

ROOT = Path(__file__).resolve().parents[1]


def inputs(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, device: str, x_pad: int = 0,
           seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Random x, a weight scaled like a trained layer's (outputs of order one) and a bias: never zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + x_pad, generator=gen).to(dtype).to(device)[:, x_pad:]
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return x, w, b


def max_err(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> float:
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    return float((out.float() - ref).abs().max() / ref.abs().max())


def run_case(spec: tuple[Any, ...], device: str) -> dict[str, Any]:
    from appliance.kernels.registry import get
    from appliance.kernels.triton.skinny_gemm import SkinnyGemmConfig, config_for

    m, n, k, dtype, bias, cfg = spec[:6]
    x, w, b = inputs(m, n, k, dtype, bias, device, *spec[6:])
    out = get("skinny_gemm", "triton")(x, w, b, config=SkinnyGemmConfig(**cfg) if cfg else config_for(m, n, k))
    return {"shape": list(out.shape), "dtype": str(out.dtype).split(".")[-1], "x_row_stride": x.stride(0),
            "err": max_err(out, x, w, b)}


def main() -> None:
    """Under TRITON_INTERPRET=1: one JSON row per case."""
    from tests.selfcheck_runner import (
        print_case_rows,  # run as `python -m tests.<this module>`
    )

    print_case_rows(CASES, run_case)


# ------------------------------------------------------------------------------------------------ CPU, interpreted
@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict[str, Any]]:
    pytest.importorskip("triton")
    from selfcheck_runner import interpreted_cases

    return interpreted_cases("tests.test_skinny_gemm", timeout=240)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_f_linear(interpreted: dict[str, dict[str, Any]], name: str) -> None:
    row = interpreted.get(name)
    assert row is not None, f"case {name} produced no result"
    assert "error" not in row, row["error"]
    m, n, k, dtype = CASES[name][:4]
    assert row["shape"] == [m, n] and row["dtype"] == str(dtype).split(".")[-1]
    assert row["x_row_stride"] == k + sum(CASES[name][6:])
    assert row["err"] <= TOL[dtype], row


def test_lab_smoke_runs_and_every_variant_matches() -> None:
    """`python -m tools.lab_gemm --smoke` (tiny shapes, the interpreter): every variant is checked, and it summarises."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tools.lab_gemm", "--smoke"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    timed = [r for r in rows if r.get("section") == "gemm"]
    assert {r["variant"] for r in timed} >= {"cublas", "triton", "triton-guess", "triton-best-nopdl"}, timed
    assert not [r for r in timed if "error" in r]
    assert all(r["ok"] and r["err"] < 0.1 for r in timed), [r for r in timed if not r.get("ok")]  # outputs ~1-5
    assert {r.get("prefetch") for r in timed if r["variant"] == "triton"} >= {0, 1, 2}
    assert {r.get("w_left") for r in timed if r["variant"] == "triton"} == {False, True}
    summary = [r for r in rows if r.get("section") == "summary"]
    assert len(summary) == len({(r["model"], r["shape"], r["m"]) for r in timed}) > 0


# ------------------------------------------------------------------------------------------------ CPU, in-process
def test_bad_arguments_raise_clear_errors() -> None:
    pytest.importorskip("triton")
    from appliance.kernels.reference.linear import SKINNY_GEMM_MAX_ROWS
    from appliance.kernels.triton.skinny_gemm import SkinnyGemmConfig, skinny_gemm

    x, w, b = inputs(20, 8, 32, bf, True, "cpu")
    with pytest.raises(ValueError, match="skinny_gemm: x .* does not fit weight"):
        skinny_gemm(x, w[:, :16])
    with pytest.raises(ValueError, match="does not fit weight"):
        skinny_gemm(x[None], w)
    with pytest.raises(ValueError, match=f"at most {SKINNY_GEMM_MAX_ROWS}"):
        skinny_gemm(torch.randn(SKINNY_GEMM_MAX_ROWS + 1, 32, dtype=bf), w)
    with pytest.raises(ValueError, match="one dtype, fp16 or bf16"):
        skinny_gemm(x, w.half())
    with pytest.raises(ValueError, match="one dtype, fp16 or bf16"):
        skinny_gemm(x.float(), w.float())
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm(x, w, b[:4])
    with pytest.raises(ValueError, match="bias"):
        skinny_gemm(x, w, b.half())
    with pytest.raises(ValueError, match="K axis must be contiguous"):
        skinny_gemm(x, torch.randn(32, 8, dtype=bf).t())
    assert skinny_gemm(x[:0], w).shape == (0, 8)  # an empty batch launches nothing
    with pytest.raises(ValueError, match="prefetch"):
        SkinnyGemmConfig(prefetch=3)
    with pytest.raises(ValueError, match="power of two"):
        SkinnyGemmConfig(block_n=48)
    with pytest.raises(ValueError, match="power of two"):
        SkinnyGemmConfig(block_k=8)


def test_guess_fills_the_gpu_for_the_decode_shapes() -> None:
    pytest.importorskip("triton")
    from appliance.kernels.triton import skinny_gemm as S

    if S.INTERPRET:
        pytest.skip("this process imported the kernels under TRITON_INTERPRET")
    qwen = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
    for (n, k), m in ((nk, m) for nk in qwen.values() for m in (17, 32, 64, 100, 128, 192, 256)):
        cfg = S.config_for(m, n, k)
        m_blocks = math.ceil(m / cfg.block_m)
        programs = m_blocks * math.ceil(n / cfg.block_n)
        assert cfg.block_m < max(65, 2 * m), (m, n, cfg)  # past 64 rows, no M block more than half padding
        # MIN_PROGRAMS where the narrowest N block can reach it, else as many as there can be
        assert programs >= min(S.MIN_PROGRAMS, m_blocks * math.ceil(n / 16)), (m, n, k, cfg, programs)
        smem = (cfg.block_m + cfg.block_n) * cfg.block_k * 2 * cfg.num_stages
        assert smem <= 200 * 1024, cfg


@pytest.mark.parametrize(("block_m", "block_n", "block_k", "prefetch", "w_left", "warps"), [
    (64, 32, 128, 2, False, 4), (64, 128, 64, 1, True, 8), (128, 64, 64, 0, False, 4), (32, 16, 128, 2, True, 4),
    (128, 128, 64, 2, True, 8)])
def test_kernel_compiles_for_hopper_with_pdl(block_m: int, block_n: int, block_k: int, prefetch: int, w_left: bool,
                                             warps: int) -> None:
    """sm_90 without a GPU: the GDC wait and trigger are in, the prefetched weight loads come before the wait,
    the K loop is pipelined (cp.async) and the half-precision tiles reach the tensor cores."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from appliance.kernels.triton import skinny_gemm as S

    fn = S._skinny_gemm_kernel
    if not isinstance(fn, triton.runtime.JITFunction):
        pytest.skip("this process imported the kernels under TRITON_INTERPRET")
    ints = ("M", "N", "K", "stride_xm", "stride_wn", "stride_ym")
    sig = {**{p: "*bf16" for p in ("x_ptr", "w_ptr", "b_ptr", "y_ptr")}, **{i: "i32" for i in ints}}
    const = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "PREFETCH": prefetch, "W_LEFT": w_left,
             "HAS_BIAS": True, "UPCAST": False, "GDC": True}
    sig.update({c: "constexpr" for c in const})
    # what the launcher specialises for the model shapes: 16-aligned pointers, sizes and strides
    div = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig if a != "M" and sig[a] != "constexpr"}
    kernel = triton.compile(ASTSource(fn=fn, signature={a: sig[a] for a in fn.arg_names}, constexprs=const,
                                      attrs=div), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait > 0 and "griddepcontrol.launch_dependents" in ptx[wait:]
    assert ("ld.global" in ptx[:wait]) == (prefetch > 0)
    assert "cp.async" in ptx[wait:] and ("wgmma" in ptx or "mma.sync" in ptx)


# ------------------------------------------------------------------------------------------------ routing
class Recorder:
    def __init__(self, mark: float) -> None:
        self.rows: list[int] = []
        self.mark = mark

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return F.linear(x, w, b) + self.mark  # marked, so the test sees whose result came back


def test_matmul_routes_17_to_256_rows_to_the_skinny_gemm() -> None:
    from appliance.layers import linear

    gemv, skinny = Recorder(1.0), Recorder(2.0)
    w = torch.randn(8, 32, dtype=bf)
    b = torch.randn(8, dtype=bf)
    plain = {rows: torch.randn(rows, 32, dtype=bf) for rows in (1, 16, 17, 100, 256, 257)}

    def whose(rows: int) -> str:
        y = linear.matmul(plain[rows], w, b, gemv, skinny)
        want = F.linear(plain[rows], w, b)
        return next(name for name, mark in (("torch", 0.0), ("gemv", 1.0), ("skinny", 2.0))
                    if torch.equal(y, want + mark if mark else want))

    # the op itself keeps cuBLAS where its kernel did not win; past its contract's 256 rows, torch
    assert [whose(r) for r in plain] == ["gemv", "gemv", "skinny", "skinny", "skinny", "torch"]
    assert skinny.rows == [17, 100, 256]
    x = plain[100]
    assert torch.equal(linear.matmul(x.float(), w.float(), None, gemv, skinny), F.linear(x.float(), w.float()))
    assert torch.equal(linear.matmul(x, w, None, gemv, None), F.linear(x, w))  # nothing bound: torch
    assert skinny.rows == [17, 100, 256]


def test_layers_and_lm_head_take_the_bound_skinny_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch import nn

    from appliance.kernels import registry
    from appliance.layers import linear
    from appliance.layers.embedding import ParallelLMHead

    torch.manual_seed(0)
    model = nn.ModuleDict({"qkv": linear.ColumnParallelLinear(32, 48, bias=True),
                           "gate_up": linear.MergedColumnParallelLinear(32, [16, 16]),
                           "o": linear.RowParallelLinear(48, 32), "head": ParallelLMHead(100, 32)})
    for p in model.parameters():
        p.data = torch.randn_like(p.data)
    model = model.to(bf)
    assert all(m.skinny is None for m in model.values())
    assert linear.use_gemv_kernel(model, "torch") == 0
    assert all(m.skinny is None for m in model.values())
    assert linear.use_gemv_kernel(model, "triton") == 4
    assert all(m.skinny is registry.get("skinny_gemm", "triton") for m in model.values())
    rec = Recorder(2.0)
    for m in model.values():
        m.skinny = rec
    x = torch.randn(40, 32, dtype=bf)
    assert torch.equal(model["qkv"](x), F.linear(x, model["qkv"].weight, model["qkv"].bias) + 2.0)
    assert model["o"](torch.randn(40, 48, dtype=bf)).shape == (40, 32)
    assert model["head"](x).shape == (40, 100)
    assert rec.rows == [40, 40, 40]


def test_backends_without_the_op_keep_their_gemv_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.kernels import registry
    from appliance.layers import linear

    layer = linear.ColumnParallelLinear(32, 16)
    monkeypatch.setitem(registry._REGISTRY, "skinny_gemm", {"torch": registry.get("skinny_gemm", "torch")})
    assert linear.use_gemv_kernel(layer, "triton") == 1
    assert layer.gemv is registry.get("gemv", "triton") and layer.skinny is None


def test_tuned_table_covers_every_row_count_once_and_fits_the_gpu() -> None:
    """Each measured shape's buckets rise to the op's 256 rows, so every row count finds one answer (a config or
    cuBLAS); each config fits an H100's shared memory; unmeasured shapes and CPU tensors take cuBLAS."""
    pytest.importorskip("triton")
    from appliance.kernels.reference.linear import SKINNY_GEMM_MAX_ROWS
    from appliance.kernels.triton import skinny_gemm as S

    for (n, k), buckets in S.tuned_table("sm90").items():
        rows = [r for r, _ in buckets]
        assert rows == sorted(set(rows)) and rows[-1] == SKINNY_GEMM_MAX_ROWS, (n, k, rows)
        for r, cfg in buckets:
            assert S.tuned_config(r, n, k, "sm90") is cfg
            assert S.tuned_config(SKINNY_GEMM_MAX_ROWS + 1, n, k, "sm90") is None
            if cfg is not None:
                assert (cfg.block_m + cfg.block_n) * cfg.block_k * 2 * cfg.num_stages <= 200 * 1024, cfg
    assert S.tuned_config(64, 4096, 1024, "sm90") is S.tuned_table("sm90")[(4096, 1024)][1][1]  # qkv at 49-96 rows
    assert S.tuned_config(200, 6144, 1024, "sm90") is None  # gate_up: cuBLAS won there
    assert S.tuned_config(32, 6144, 4096, "sm90") is None  # Llama-3.1-8B's shapes were not wins
    x, w = torch.randn(64, 1024, dtype=bf), torch.randn(4096, 1024, dtype=bf)
    assert torch.equal(S.skinny_gemm(x, w), F.linear(x, w))  # a CPU tensor: cuBLAS's place, torch


# ------------------------------------------------------------------------------------------------ GPU
GPU_SHAPES = {"qwen3-qkv": (4096, 1024), "qwen3-o": (1024, 2048), "qwen3-gate_up": (6144, 1024),
              "qwen3-down": (1024, 3072), "llama8b-qkv": (6144, 4096), "llama8b-o": (4096, 4096),
              "llama8b-gate_up": (28672, 4096), "llama8b-down": (4096, 14336)}
GPU_TOL = 1e-2  # max |err| over max |ref| for bf16 outputs of order one


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [32, 128, 256])
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
def test_gpu_decode_shapes_match_f_linear(shape: str, m: int) -> None:
    from appliance.kernels.triton.skinny_gemm import (
        config_for,
        skinny_gemm,
        tuned_config,
    )

    n, k = GPU_SHAPES[shape]
    x, w, b = inputs(m, n, k, bf, m == 128, "cuda")
    assert max_err(skinny_gemm(x, w, b, config=config_for(m, n, k)), x, w, b) <= GPU_TOL
    from appliance.kernels import cublaslt

    routed = skinny_gemm(x, w, b)  # the measured winner, or cuBLAS itself (with cublaslt's measured algorithm)
    if tuned_config(m, n, k, "sm90") is None and cublaslt.tuned_algo(x, w, b) is None:
        assert torch.equal(routed, F.linear(x, w, b))
    else:
        assert max_err(routed, x, w, b) <= GPU_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("prefetch", "w_left"), [(0, False), (2, False), (1, True), (2, True)])
def test_gpu_graph_with_pdl_matches_eager(prefetch: int, w_left: bool) -> None:
    """[a torch RMSNorm-like op, skinny GEMM, the Triton rms_norm (PDL, triggers early), skinny GEMM] captured
    and replayed on new inputs: the GEMMs wait for their x (one reading x before gdc_wait would see the last
    replay's) and give what F.linear gives, and the bits of the eager (plain launch) chain."""
    from appliance.kernels.triton.norm import rms_norm
    from appliance.kernels.triton.skinny_gemm import (
        SkinnyGemmConfig,
        config_for,
        skinny_gemm,
    )

    m, hidden, inter = 128, 1024, 3072
    x_in = torch.randn(m, hidden, device="cuda", dtype=bf)
    g = torch.randn(inter, device="cuda", dtype=bf) * 0.1 + 1
    w1 = torch.randn(inter, hidden, device="cuda", dtype=bf) / hidden**0.5
    w2 = torch.randn(hidden, inter, device="cuda", dtype=bf) / inter**0.5
    cfgs = [SkinnyGemmConfig(**{**config_for(m, n, k).__dict__, "prefetch": prefetch, "w_left": w_left})
            for n, k in ((inter, hidden), (hidden, inter))]

    def normed() -> torch.Tensor:
        return x_in * torch.rsqrt(x_in.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(bf)

    def chain() -> torch.Tensor:
        u = skinny_gemm(normed(), w1, config=cfgs[0])
        return skinny_gemm(rms_norm(u, g, 1e-6), w2, config=cfgs[1])

    def reference() -> torch.Tensor:
        u = F.linear(normed().float(), w1.float()).to(bf)
        return F.linear(rms_norm(u, g, 1e-6).float(), w2.float())

    chain()  # compiles the plain launches outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain()
    for seed in range(3):
        x_in.copy_(torch.randn(m, hidden, generator=torch.Generator().manual_seed(seed)).to("cuda", bf))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference()
        assert float((out.float() - ref).abs().max() / ref.abs().max()) <= 2 * GPU_TOL, seed
        assert torch.equal(out, chain()), seed


if __name__ == "__main__":
    sys.exit(main())
