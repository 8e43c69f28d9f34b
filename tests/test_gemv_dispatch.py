"""Linear layers route decode-sized half-precision batches to the bound GEMV op and everything else to torch."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from appliance.kernels.reference.linear import GEMV_MAX_ROWS
from appliance.layers.embedding import ParallelLMHead
from appliance.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    matmul,
    use_gemv_kernel,
)


class Recorder:
    def __init__(self) -> None:
        self.rows: list[int] = []

    def __call__(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return F.linear(x, w, b) + 1.0  # marked, so the test sees whose result came back


def _tiny(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    m = nn.ModuleDict({"qkv": ColumnParallelLinear(32, 48, bias=True), "gate_up": MergedColumnParallelLinear(32, [16, 16]),
                       "o": RowParallelLinear(48, 32), "head": ParallelLMHead(100, 32)})
    for p in m.parameters():
        p.data = torch.randn_like(p.data)
    return m.to(dtype)


def test_decode_sized_half_batches_take_the_gemv():
    model = _tiny(torch.bfloat16)
    rec = Recorder()
    for module in model.values():
        module.gemv = rec
    for rows, routed in ((1, True), (GEMV_MAX_ROWS, True), (GEMV_MAX_ROWS + 1, False)):
        x = torch.randn(rows, 32, dtype=torch.bfloat16)
        y = model["qkv"](x)
        want = F.linear(x, model["qkv"].weight, model["qkv"].bias)
        assert torch.equal(y, want + 1.0 if routed else want)
        logits = model["head"](x)
        assert logits.shape == (rows, 100)
    assert rec.rows == [1, 1, GEMV_MAX_ROWS, GEMV_MAX_ROWS]


def test_fp32_and_unbound_layers_stay_on_torch():
    rec = Recorder()
    x = torch.randn(2, 32)
    w = torch.randn(8, 32)
    assert torch.equal(matmul(x, w, None, rec), F.linear(x, w))  # fp32: tl.dot would round through tf32
    assert torch.equal(matmul(x.bfloat16(), w.bfloat16(), None, None), F.linear(x.bfloat16(), w.bfloat16()))
    with pytest.raises(RuntimeError):  # mixed dtypes are not routed: torch's own error surfaces
        matmul(x.bfloat16(), w.half(), None, rec)
    assert rec.rows == []


def test_use_gemv_kernel_binds_every_linear_and_the_lm_head():
    model = _tiny(torch.bfloat16)
    assert use_gemv_kernel(model, "torch") == 0  # torch's GEMV is cuBLAS itself: nothing to bind
    assert all(m.gemv is None for m in model.values())
    assert use_gemv_kernel(model, "triton") == 4
    from appliance.kernels import registry

    assert all(m.gemv is registry.get("gemv", "triton") for m in model.values())
