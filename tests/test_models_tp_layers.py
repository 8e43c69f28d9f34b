"""Tensor-parallel layers: shards cut for each rank of a (simulated) tp=2 group recombine to the full layer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from appliance.layers import parallel_state
from appliance.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from appliance.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)

TP = 2
g = torch.Generator().manual_seed(0)


def _rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


def _on_rank(monkeypatch, rank: int, build):
    """Build a layer as rank `rank` of a tp=2 group (collectives are not called by these checks)."""
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(rank, TP, None))
    return build()


def test_column_parallel_shards_concatenate(monkeypatch):
    w, b, x = _rand(8, 6), _rand(8), _rand(3, 6)
    outs = []
    for r in range(TP):
        layer = _on_rank(monkeypatch, r, lambda: ColumnParallelLinear(6, 8, bias=True))
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
        outs.append(layer(x))
    assert torch.allclose(torch.cat(outs, -1), F.linear(x, w, b), atol=1e-5)


def test_row_parallel_partial_sums_add_up(monkeypatch):
    w, b, x = _rand(5, 8), _rand(5), _rand(3, 8)
    partial = []
    for r in range(TP):
        layer = _on_rank(monkeypatch, r, lambda: RowParallelLinear(8, 5, bias=True, reduce_results=False))
        layer.weight.weight_loader(layer.weight, w)
        partial.append(F.linear(x[:, r * 4 : (r + 1) * 4], layer.weight))
    assert torch.allclose(sum(partial) + b, F.linear(x, w, b), atol=1e-5)


def test_merged_column_gate_up(monkeypatch):
    gate, up, x = _rand(6, 4), _rand(6, 4), _rand(2, 4)
    for r in range(TP):
        layer = _on_rank(monkeypatch, r, lambda: MergedColumnParallelLinear(4, [6, 6]))
        layer.weight.weight_loader(layer.weight, gate, 0)
        layer.weight.weight_loader(layer.weight, up, 1)
        g_out, u_out = layer(x).chunk(2, -1)
        assert torch.allclose(g_out, F.linear(x, gate[r * 3 : (r + 1) * 3]), atol=1e-5)
        assert torch.allclose(u_out, F.linear(x, up[r * 3 : (r + 1) * 3]), atol=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 1])  # split kv heads, and a single kv head replicated on both ranks
def test_qkv_heads_split_and_replicated(monkeypatch, kv_heads):
    d, heads, hidden = 2, 4, 6
    wq, wk, wv = _rand(heads * d, hidden), _rand(kv_heads * d, hidden), _rand(kv_heads * d, hidden)
    for r in range(TP):
        layer = _on_rank(monkeypatch, r, lambda: QKVParallelLinear(hidden, d, heads, kv_heads))
        for sid, w in (("q", wq), ("k", wk), ("v", wv)):
            layer.weight.weight_loader(layer.weight, w, sid)
        q, k, v = layer.weight.split([layer.q_size, layer.kv_size, layer.kv_size])
        assert torch.equal(q, wq[r * 2 * d : (r + 1) * 2 * d])
        kv_rank = r if kv_heads >= TP else 0
        per = layer.num_kv_heads * d
        assert torch.equal(k, wk[kv_rank * per : (kv_rank + 1) * per])
        assert torch.equal(v, wv[kv_rank * per : (kv_rank + 1) * per])


def test_vocab_parallel_embedding_and_head(monkeypatch):
    vocab, dim = 70, 4  # padded to 128: rank 0 holds 0..63, rank 1 holds 64..69 plus zero padding
    w = _rand(vocab, dim)
    ids = torch.tensor([0, 5, 63, 64, 69])
    h = _rand(3, dim)
    emb_sum = torch.zeros(len(ids), dim)
    logits = []
    for r in range(TP):
        emb = _on_rank(monkeypatch, r, lambda: VocabParallelEmbedding(vocab, dim))
        emb.weight_loader(emb.weight, w)
        mine = (ids >= emb.vocab_start) & (ids < emb.vocab_end)
        local = torch.where(mine, ids - emb.vocab_start, 0)
        emb_sum += F.embedding(local, emb.weight) * mine[:, None]
        head = _on_rank(monkeypatch, r, lambda: ParallelLMHead(vocab, dim))
        head.weight_loader(head.weight, w)
        logits.append(F.linear(h, head.weight))
    assert torch.allclose(emb_sum, w[ids])
    assert torch.allclose(torch.cat(logits, -1)[:, :vocab], h @ w.T, atol=1e-5)


def test_indivisible_sizes_are_errors(monkeypatch):
    with pytest.raises(ValueError, match="divisible"):
        _on_rank(monkeypatch, 0, lambda: ColumnParallelLinear(4, 7))
    with pytest.raises(ValueError):
        parallel_state.init_tensor_parallel(0, 2, None)
