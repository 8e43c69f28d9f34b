"""kernels/cublaslt.py: cuBLASLt with the measured algorithm per decode GEMM shape, and cuBLAS at a measured
better row count (PADDED) for larger batches.

CPU: the tables' form, the routing that sends everything but a tuned sm_90 bf16 call to F.linear, the padding
(zero rows in, the real rows out; TUNED first), the skinny op and the layers' large batches reaching it. GPU
(@pytest.mark.gpu): every TUNED entry is accepted by the library (not a silent fallback) and matches F.linear on
random inputs; a captured graph replays it on new inputs; the skinny op runs it; every PADDED entry matches
F.linear, also replayed from a graph.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from appliance.kernels import cublaslt
from appliance.kernels.cublaslt import LtAlgo, LtTables

SM90 = cublaslt.tables("sm90")
TUNED, PADDED = SM90.algos, SM90.padded
from appliance.kernels.reference.linear import GEMV_MAX_ROWS, SKINNY_GEMM_MAX_ROWS

gpu = pytest.mark.gpu
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                reason="needs an sm_90 GPU (the table holds for sm_90)")


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 output, rounded once: within 1% of the largest |ref| (the error of a wrong algorithm is O(1))."""
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= 1e-2 * ref.float().abs().max().item(), err


def test_table_covers_skinny_rows_of_known_shapes() -> None:
    assert TUNED, "the table is empty: nothing would run through cuBLASLt"
    for (n, k), by_rows in TUNED.items():
        assert n > 0 and k > 0 and n % 8 == 0 and k % 8 == 0, (n, k)
        for rows, spec in by_rows.items():
            # the op is reached only past the GEMV and up to the skinny GEMM's limit, at capture sizes (x8)
            assert GEMV_MAX_ROWS < rows <= SKINNY_GEMM_MAX_ROWS and rows % 8 == 0, ((n, k), rows)
            assert isinstance(spec, LtAlgo)
            for f in dataclasses.fields(spec):
                v = getattr(spec, f.name)
                assert isinstance(v, int) and 0 <= v < 2**16, (f.name, v)
            assert spec.splitk == 1, "split-K needs a workspace, which the op does not give"


def test_cpu_and_untuned_calls_go_to_f_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    (n, k), by_rows = next(iter(TUNED.items()))
    m = next(iter(by_rows))
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    assert cublaslt.tuned_algo(x, w, None) is None  # CPU tensors
    assert torch.equal(cublaslt.linear(x, w), F.linear(x, w))
    b = torch.randn(n, dtype=torch.bfloat16)
    assert torch.equal(cublaslt.linear(x, w, b), F.linear(x, w, b))
    assert cublaslt.tables("sm80") == LtTables({}, {})  # nothing measured there: cuBLAS's own pick


def test_skinny_op_falls_back_through_cublaslt_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    from appliance.kernels.triton.skinny_gemm import skinny_gemm

    calls = []
    real = cublaslt.linear
    monkeypatch.setattr(cublaslt, "linear", lambda x, w, b=None: calls.append(x.shape) or real(x, w, b))
    x, w = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert torch.equal(skinny_gemm(x, w), F.linear(x, w))
    assert calls == [torch.Size([40, 64])]


def test_padded_table_pads_to_more_rows_past_the_skinny_op() -> None:
    assert PADDED, "the table is empty"
    for (n, k), by_rows in PADDED.items():
        for rows, to in by_rows.items():
            # the layers send only batches past the skinny op here; padding stays within 1.3x (what was measured)
            assert SKINNY_GEMM_MAX_ROWS < rows < to <= 1.3 * rows and rows not in TUNED.get((n, k), {}), (n, k, rows)


def test_padded_linear_keeps_the_real_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """An eligible call at a PADDED row count runs F.linear on zero-padded input and returns its own rows; an
    ineligible call (CPU, bias) is not padded."""
    seen: list[tuple[int, ...]] = []
    real = F.linear
    def recording(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", recording)
    x, w = torch.randn(5, 16), torch.randn(24, 16)
    assert torch.equal(cublaslt.linear(x, w), real(x, w)) and seen == [(5, 16)]  # CPU: not eligible
    padded = LtTables({}, {(24, 16): {5: 8}})
    monkeypatch.setattr(cublaslt, "_eligible", lambda x, w, b: padded if b is None else None)
    seen.clear()
    out = cublaslt.linear(x, w)
    assert seen == [(8, 16)] and out.shape == (5, 24) and out.is_contiguous()
    torch.testing.assert_close(out, real(x, w))
    padded_input = torch.cat([x, torch.zeros(3, 16)])
    assert torch.equal(out, real(padded_input, w)[:5])
    seen.clear()
    cublaslt.linear(x, w, torch.randn(24))
    assert seen == [(5, 16)]


def test_layers_send_large_batches_through_cublaslt_with_a_kernel_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.layers.linear import matmul

    calls = []
    monkeypatch.setattr(cublaslt, "linear", lambda x, w, b=None: calls.append(x.shape[0]) or F.linear(x, w, b))
    skinny = lambda x, w, b=None: F.linear(x, w, b)  # noqa: E731 - a bound skinny op stands for a kernel backend
    w = torch.randn(32, 64, dtype=torch.bfloat16)
    for rows in (SKINNY_GEMM_MAX_ROWS + 1, 448):
        matmul(torch.randn(rows, 64, dtype=torch.bfloat16), w, None, None, skinny)
    matmul(torch.randn(448, 64, dtype=torch.bfloat16), w, None, None, None)  # the torch backend: F.linear itself
    assert calls == [SKINNY_GEMM_MAX_ROWS + 1, 448]


@gpu
@needs_sm90
@pytest.mark.parametrize("shape", sorted(TUNED))
def test_gpu_every_tuned_algorithm_runs_and_matches(shape: tuple[int, int]) -> None:
    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    for m in TUNED[shape]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        assert cublaslt.tuned_algo(x, w, None) == TUNED[shape][m]
        out = cublaslt.linear(x, w)
        assert cublaslt._READY[(x.device.index, m, n, k)] is not None, f"{m} rows: the library refused the algorithm"
        _close(out, F.linear(x, w))


@gpu
@needs_sm90
def test_gpu_captured_graph_replays_on_new_inputs() -> None:
    (n, k), by_rows = max(TUNED.items(), key=lambda kv: len(kv[1]))
    m = max(by_rows)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cublaslt.linear(x, w)  # builds the problem and algorithm outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cublaslt.linear(x, w)
    for seed in (1, 2):
        g = torch.Generator("cuda").manual_seed(seed)
        x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        _close(y, F.linear(x, w))


@gpu
@needs_sm90
def test_gpu_skinny_op_runs_the_tuned_algorithm() -> None:
    from appliance.kernels.triton.skinny_gemm import skinny_gemm, tuned_config

    (n, k), by_rows = next((s, r) for s, r in TUNED.items()
                           if any(tuned_config(m, *s, "sm90") is None for m in r))
    m = next(m for m in by_rows if tuned_config(m, n, k, "sm90") is None)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    cublaslt._READY.pop((x.device.index, m, n, k), None)
    _close(skinny_gemm(x, w), F.linear(x, w))
    assert cublaslt._READY[(x.device.index, m, n, k)] is not None


@gpu
@needs_sm90
@pytest.mark.parametrize("shape", sorted(PADDED))
def test_gpu_every_padded_row_count_matches_and_replays(shape: tuple[int, int]) -> None:
    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(n * k)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.05
    for m in PADDED[shape]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        assert cublaslt.padded_rows(x, w, None) == PADDED[shape][m]
        _close(cublaslt.linear(x, w), F.linear(x, w))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = cublaslt.linear(x, w)
        x.copy_(torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g))
        graph.replay()
        torch.cuda.synchronize()
        assert y.shape == (m, n)
        _close(y, F.linear(x, w))
