"""Programmatic dependent launch (kernels/triton/common.py): only CUDA graph captures on sm_90+ ask for it, and
the decode chain captured with it computes what it computes without (GPU)."""
from __future__ import annotations

import pytest
import torch

from appliance.kernels.triton import common


def test_eager_and_cpu_launches_never_ask_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not common.pdl_on(torch.zeros(4))
    assert common.pdl_kwargs(torch.zeros(4)) == {"GDC": False}
    monkeypatch.setattr(common, "pdl_on", lambda t: True)
    assert common.pdl_kwargs(torch.zeros(4)) == {"GDC": True, "launch_pdl": True}


def _chain(x: torch.Tensor, w_norm: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    from appliance.kernels.triton.activation import silu_and_mul
    from appliance.kernels.triton.gemv import gemv
    from appliance.kernels.triton.norm import rms_norm

    for _ in range(4):  # a layer's small kernels and GEMVs back to back, each reading the one before
        h, x = rms_norm(x, w_norm, 1e-6, residual=x)
        x = x + gemv(silu_and_mul(gemv(h, w_up)), w_down)
    return x


@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_with_pdl_matches_without(rows: int) -> None:
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(rows, 2048, device=dev, dtype=dt)
    w_norm = torch.randn(2048, device=dev, dtype=dt)
    w_up = torch.randn(2 * 5632, 2048, device=dev, dtype=dt) * 0.02
    w_down = torch.randn(2048, 5632, device=dev, dtype=dt) * 0.02
    eager = _chain(x, w_norm, w_up, w_down)
    outs = {}
    saved = common.PDL
    try:
        for pdl in (True, False):
            common.PDL = pdl
            _chain(x, w_norm, w_up, w_down)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = _chain(x, w_norm, w_up, w_down)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
            outs[pdl] = out.clone()
    finally:
        common.PDL = saved
    assert torch.equal(outs[True], outs[False]) and torch.equal(outs[False], eager)
    assert torch.isfinite(eager).all() and eager.abs().sum() > 0
