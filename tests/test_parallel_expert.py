"""Expert parallelism (ep = tp), simulated: each rank holds half the experts whole and weighs the other half's
tokens 0; the ranks' partial outputs (shared experts tensor-split as under plain tp) add up to the ep=1 block."""
from __future__ import annotations

import pytest
import torch

from appliance.layers import linear, moe, parallel_state
from appliance.layers.moe import GatedMLP, RouterConfig, SparseMoeBlock

EP = 2
H, E, I, SHARED = 16, 4, 8, 12


@pytest.fixture()
def as_rank(monkeypatch: pytest.MonkeyPatch):
    """as_rank(r, size, ep) sets the group state; all-reduces become identities (the test sums the ranks)."""
    for module in (linear, moe):
        monkeypatch.setattr(module, "tp_all_reduce", lambda x: x)

    def set_rank(rank: int, size: int, ep: bool) -> None:
        monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(rank, size, None))
        monkeypatch.setattr(parallel_state, "_EXPERT_PARALLEL", ep)

    yield set_rank
    parallel_state.init_expert_parallel(False)


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"router": torch.randn(E, H), "gate": torch.randn(E, I, H), "up": torch.randn(E, I, H),
            "down": torch.randn(E, H, I), "s_gate": torch.randn(SHARED, H), "s_up": torch.randn(SHARED, H),
            "s_down": torch.randn(H, SHARED)}


def _block(w: dict[str, torch.Tensor], fused: bool) -> SparseMoeBlock:
    block = SparseMoeBlock(H, I, RouterConfig(E, 2, renormalize=True), shared=GatedMLP(H, SHARED))
    block.gate.weight.data.copy_(w["router"])
    ex = block.experts
    if fused:  # transformers' 3-D layout
        ex.load_fused("gate_up_proj", torch.cat([w["gate"], w["up"]], dim=1))
        ex.load_fused("down_proj", w["down"])
    else:
        for e in range(E):
            ex.load_expert(ex.w13_weight, w["gate"][e], e, 0)
            ex.load_expert(ex.w13_weight, w["up"][e], e, 1)
            ex.load_expert(ex.w2_weight, w["down"][e], e, None)
    shared = block.shared_experts
    shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, w["s_gate"], 0)
    shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, w["s_up"], 1)
    shared.down_proj.weight_loader(shared.down_proj.weight, w["s_down"])
    return block


@pytest.mark.parametrize("fused", [False, True])
def test_expert_parallel_partial_sums_add_up(as_rank, fused: bool) -> None:
    w, x = _weights(), torch.randn(9, H)
    as_rank(0, 1, False)
    full = _block(w, fused)(x)
    parts = []
    for rank in range(EP):
        as_rank(rank, EP, True)
        block = _block(w, fused)
        ex = block.experts
        assert ex.w13_weight.shape == (E // EP, 2 * I, H)  # half the experts, whole
        assert torch.equal(ex.w2_weight[1], w["down"][rank * (E // EP) + 1])
        parts.append(block(x))
    assert not torch.allclose(parts[0], full, atol=1e-3)  # each rank alone is only a part
    torch.testing.assert_close(parts[0] + parts[1], full, rtol=1e-4, atol=1e-4)


def test_ep_must_equal_tp() -> None:
    from appliance.config import ApplianceConfig
    from appliance.config.support import check_supported

    ok = ApplianceConfig.model_validate({"parallelism": {"tp": 2, "enable_expert_parallel": True}})
    assert check_supported(ok) == []
    across = ApplianceConfig.model_validate({"parallelism": {"tp": 2, "dp": 2, "enable_expert_parallel": True}})
    assert any("ep must equal tp" in m for m in check_supported(across))
