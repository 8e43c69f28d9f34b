"""Simulated tp=2 for the MoE block (experts split along the intermediate dimension, shared experts too) and for
MLA (heads split, latent cache replicated): the ranks' partial outputs add up to the tp=1 layer's output."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from appliance.layers import linear, moe, parallel_state
from appliance.layers.attention import AttentionMetadata
from appliance.layers.mla import MultiHeadLatentAttention
from appliance.layers.moe import GatedMLP, RouterConfig, SparseMoeBlock

TP = 2
H, E, I, SHARED = 16, 4, 8, 12


@pytest.fixture()
def as_rank(monkeypatch: pytest.MonkeyPatch):
    """as_rank(r, size) sets the tensor-parallel state; all-reduces become identities (the test sums ranks)."""
    for module in (linear, moe):
        monkeypatch.setattr(module, "tp_all_reduce", lambda x: x)

    def set_rank(rank: int, size: int = TP) -> None:
        monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(rank, size, None))

    return set_rank


def _load_block(block: SparseMoeBlock, w: dict[str, torch.Tensor]) -> None:
    block.gate.weight.data.copy_(w["router"])
    for e in range(E):
        block.experts.load_expert(block.experts.w13_weight, w["gate"][e], e, 0)
        block.experts.load_expert(block.experts.w13_weight, w["up"][e], e, 1)
        block.experts.load_expert(block.experts.w2_weight, w["down"][e], e, None)
    shared = block.shared_experts
    shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, w["s_gate"], 0)
    shared.gate_up_proj.weight_loader(shared.gate_up_proj.weight, w["s_up"], 1)
    shared.down_proj.weight_loader(shared.down_proj.weight, w["s_down"])


def test_moe_block_partial_sums_add_up(as_rank) -> None:
    torch.manual_seed(0)
    w = {"router": torch.randn(E, H), "gate": torch.randn(E, I, H), "up": torch.randn(E, I, H),
         "down": torch.randn(E, H, I), "s_gate": torch.randn(SHARED, H), "s_up": torch.randn(SHARED, H),
         "s_down": torch.randn(H, SHARED)}
    x = torch.randn(7, H)
    router = RouterConfig(E, 2, renormalize=True)
    outs = []
    for rank, size in [(0, 1), (0, TP), (1, TP)]:
        as_rank(rank, size)
        block = SparseMoeBlock(H, I, router, shared=GatedMLP(H, SHARED))
        _load_block(block, w)
        assert block.experts.w13_weight.shape == (E, 2 * I // size, H)
        outs.append(block(x))
    torch.testing.assert_close(outs[1] + outs[2], outs[0], rtol=1e-4, atol=1e-4)


def _mla_cfg() -> SimpleNamespace:
    return SimpleNamespace(hidden_size=H, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=8, v_head_dim=6,
                           qk_nope_head_dim=4, qk_rope_head_dim=4, attention_bias=False, max_position_embeddings=64,
                           rope_theta=10000.0, rope_scaling=None)


def _meta_prefill(n: int) -> AttentionMetadata:
    i32 = {"dtype": torch.int32}
    return AttentionMetadata(torch.arange(n, dtype=torch.int64), 0, torch.zeros(0, 1, **i32), torch.zeros(0, **i32),
                             torch.tensor([0, n], **i32), torch.tensor([n], **i32), torch.tensor([[0, 1]], **i32))


def _meta_decode(pos: int) -> AttentionMetadata:
    i32 = {"dtype": torch.int32}
    return AttentionMetadata(torch.tensor([pos]), 1, torch.tensor([[0, 1]], **i32), torch.tensor([pos + 1], **i32),
                             torch.zeros(1, **i32), torch.zeros(0, **i32), torch.zeros(0, 1, **i32))


def test_mla_head_split_partial_sums_add_up(as_rank) -> None:
    torch.manual_seed(1)
    cfg = _mla_cfg()
    full = {"q_proj": torch.randn(4 * 8, H), "kv_a_proj_with_mqa": torch.randn(8 + 4, H),
            "kv_b_proj": torch.randn(4 * (4 + 6), 8), "o_proj": torch.randn(H, 4 * 6)}
    x, positions = torch.randn(6, H), torch.arange(6)
    prefill, decode = [], []
    for rank, size in [(0, 1), (0, TP), (1, TP)]:
        as_rank(rank, size)
        attn = MultiHeadLatentAttention(cfg)
        for name, tensor in full.items():
            param = getattr(attn, name).weight
            param.weight_loader(param, tensor)
        attn.attn.bind_kv_cache(torch.zeros(2, 4, 1, 12))
        prefill.append(attn(positions[:5], x[:5], _meta_prefill(5)))
        decode.append(attn(positions[5:], x[5:], _meta_decode(5)))
    torch.testing.assert_close(prefill[1] + prefill[2], prefill[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode[1] + decode[2], decode[0], rtol=1e-4, atol=1e-4)
