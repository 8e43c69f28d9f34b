"""Tensor parallelism of the Gated DeltaNet layer (heads split over the ranks, the state cache holding each rank's
heads): simulated tp=2 partial outputs add up to the tp=1 layer's over a chunked prefill and decode steps, for both
projection layouts; and the real pipeline, two gloo worker processes, gives transformers' greedy tokens."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from appliance.layers import linear, parallel_state
from appliance.layers.attention import AttentionMetadata, SequenceStates
from appliance.layers.gated_delta_net import GatedDeltaNet

TP = 2
CFG = SimpleNamespace(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                      linear_value_head_dim=8, linear_conv_kernel_dim=4, hidden_size=16, rms_norm_eps=1e-6)


@pytest.fixture()
def as_rank(monkeypatch: pytest.MonkeyPatch):
    """as_rank(r, size) sets the tensor-parallel state; all-reduces become identities (the test sums ranks)."""
    monkeypatch.setattr(linear, "tp_all_reduce", lambda x: x)

    def set_rank(rank: int, size: int = TP) -> None:
        monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(rank, size, None))

    return set_rank


def _layer(split: bool, weights: dict[str, torch.Tensor]) -> GatedDeltaNet:
    layer = GatedDeltaNet(CFG, "torch", split)
    for name, param in layer.named_parameters():
        getattr(param, "weight_loader", lambda p, w: p.data.copy_(w))(param, weights[name])
    conv = torch.zeros(3, layer.conv_dim, layer.conv_kernel_size - 1)
    ssm = torch.zeros(3, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim)
    layer.bind_state_cache(conv, ssm)
    return layer


def _meta(n_prefill: int, start: int) -> AttentionMetadata:
    """One request in slot 1: a prefill chunk of n_prefill tokens from start, or (n_prefill 0) one decode row."""
    z = torch.zeros(1, dtype=torch.int32)
    if n_prefill:
        states = SequenceStates(torch.zeros(0, dtype=torch.int64), [1], [start == 0], [0, n_prefill])
        return AttentionMetadata(torch.zeros(n_prefill, dtype=torch.int64), 0, z[:0].view(0, 1), z[:0], z, z, z,
                                 states=states)
    states = SequenceStates(torch.ones(1, dtype=torch.int64), [], [], [0])
    return AttentionMetadata(torch.zeros(1, dtype=torch.int64), 1, z.view(1, 1), z, z[:1], z[:0], z[:0].view(0, 1),
                             states=states)


@pytest.mark.parametrize("split", [False, True])  # Qwen3-Next's grouped projections, Qwen3.5's separate ones
def test_head_split_partial_sums_add_up(as_rank: Any, split: bool) -> None:
    torch.manual_seed(0)
    as_rank(0, 1)
    full = GatedDeltaNet(CFG, "torch", split)
    weights = {n: torch.randn(p.shape) * (0.3 if p.dim() > 1 else 1.0) for n, p in full.named_parameters()}
    full = _layer(split, weights)
    ranks = []
    for r in range(TP):
        as_rank(r)
        ranks.append(_layer(split, weights))
    x = torch.randn(12, CFG.hidden_size)
    # a 7-token chunk, a 3-token chunk continuing it, two decode steps: the states carry across all of them
    for a, b in ((0, 7), (7, 10), (10, 11), (11, 12)):
        positions = torch.arange(a, b)
        meta = _meta(b - a if b - a > 1 else 0, a)
        as_rank(0, 1)
        want = full(positions, x[a:b], meta)
        got = 0
        for r, layer in enumerate(ranks):
            as_rank(r)
            got = got + layer(positions, x[a:b], meta)
        assert torch.allclose(got, want, atol=1e-4), (a, b)
    # each rank's state is its heads' rows of the full state
    for r, layer in enumerate(ranks):
        per = full.num_v_heads // TP
        assert torch.allclose(layer.ssm_state[1], full.ssm_state[1][r * per : (r + 1) * per], atol=1e-5)


def test_indivisible_heads_are_refused(as_rank: Any) -> None:
    as_rank(0, 4)
    with pytest.raises(ValueError, match="must divide the linear-attention heads"):
        GatedDeltaNet(CFG, "torch")


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_offline_tp2_matches_transformers(arch: str, make_tiny_model: Any, hf_greedy: Any) -> None:
    from appliance import LLM, SamplingParams
    from tests.test_models_vs_transformers import PROMPTS

    path = make_tiny_model(arch)
    prompts = PROMPTS[:3] + [list(range(3, 48))]
    refs = [t for t, _ in hf_greedy(path, prompts, 8)]
    llm = LLM(model=str(path), dtype="float32", block_size=4, chunked_prefill_size=16, tensor_parallel_size=2,
              max_total_tokens=2048)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == refs
    finally:
        llm.shutdown()
