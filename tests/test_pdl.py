"""Programmatic dependent launch (kernels/triton/common.py): only CUDA graph captures on sm_90+ ask for it, and
the decode chain captured with it computes what it computes without (GPU)."""
from __future__ import annotations

import pytest
import torch
from flashinfer_cases import paged_kv

from appliance.kernels.reference.rope import cos_sin_cache
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
    real = common.pdl_on
    try:
        for pdl in (True, False):
            common.pdl_on = real if pdl else (lambda t: False)
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
        common.pdl_on = real
    assert torch.equal(outs[True], outs[False]) and torch.equal(outs[False], eager)
    assert torch.isfinite(eager).all() and eager.abs().sum() > 0


def _attention_step(args: dict, res: torch.Tensor) -> torch.Tensor:
    """The decode chain around attention, as a layer runs it: the qkv GEMV storing the newest K/V rows (at one row
    it lets the attention launch as it starts), decode attention, the o GEMV adding to the residual."""
    from appliance.kernels.registry import get

    import appliance.kernels.triton  # noqa: F401

    q = get("gemv_normed_rope_store", "triton")(args["xs"], args["w_qkv"], None, args["partials"], 1e-6,
                                                args["positions"], 8, 2, 128, args["cos_sin"], args["k_cache"],
                                                args["v_cache"], args["slots"])
    attn = get("decode_attention", "triton")(q, args["k_cache"], args["v_cache"], args["table"], args["lens"],
                                             128**-0.5)
    get("gemv_residual", "triton")(attn.view(q.shape[0], -1), args["w_o"], res, None)
    return res


@pytest.mark.parametrize("lens", [[1000], [300, 17, 1]])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_attention_under_pdl_sees_the_newest_row(lens: list[int]) -> None:
    """Captured with PDL, the decode attention launched early still reads the newest K/V rows the qkv kernel just
    wrote (zeroed before each replay, so a read before the write shows); equal to plain launches bit for bit."""
    torch.manual_seed(0)
    dev, dt, block_size, m = "cuda", torch.bfloat16, 16, len(lens)
    k_cache, v_cache, table = paged_kv(lens, block_size, 2, 128, dt, dev,
                                       spare_cols=64 - max(-(-n // block_size) for n in lens))
    slots = torch.tensor([int(table[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(lens)])
    h = torch.randn(m, 1024, device=dev, dtype=dt)
    args = {"xs": h, "partials": h.float().pow(2).sum(-1, keepdim=True),
            "positions": torch.tensor(lens, device=dev) - 1,
            "w_qkv": torch.randn(12 * 128, 1024, device=dev, dtype=dt) / 32,
            "w_o": torch.randn(1024, 1024, device=dev, dtype=dt) / 32,
            "cos_sin": cos_sin_cache(128, 2048).to(dev), "slots": slots.to(dev),
            "table": table, "lens": torch.tensor(lens, dtype=torch.int32, device=dev),
            "k_cache": k_cache, "v_cache": v_cache}
    res0 = torch.randn(m, 1024, device=dev, dtype=dt)
    eager = _attention_step(args, res0.clone())
    outs = {}
    real = common.pdl_on
    try:
        for pdl in (True, False):
            common.pdl_on = real if pdl else (lambda t: False)
            res = res0.clone()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                _attention_step(args, res)
            outs[pdl] = []
            for _ in range(3):
                res.copy_(res0)
                # the newest rows: only the replay writes them
                args["k_cache"].view(-1, 2, 128)[args["slots"]] = 0.0
                args["v_cache"].view(-1, 2, 128)[args["slots"]] = 0.0
                graph.replay()
                torch.cuda.synchronize()
                outs[pdl].append(res.clone())
    finally:
        common.pdl_on = real
    for a, b in zip(outs[True], outs[False]):
        assert torch.equal(a, b) and torch.equal(b, eager)
    assert torch.isfinite(eager).all()
