"""Paged attention layer: stores this step's K/V into the cache, then attends over the cache.

One forward mixes decodes and prefill chunks. The runner puts the single-token rows first (they go through
`decode_attention`) and the multi-token chunks after them (`prefill_attention`, which also sees the cached
prefix), so both kernels get contiguous slices.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from appliance.layers.kernels import kernel


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of every row (-1: do not store)
    num_decode_tokens: int  # rows [0, num_decode_tokens) are one-token requests
    decode_block_tables: torch.Tensor  # [Bd, M] int32
    decode_seq_lens: torch.Tensor  # [Bd] int32, context length including the new token
    prefill_cu_seqlens: torch.Tensor  # [Bp+1] int32, offsets into the prefill rows
    prefill_seq_lens: torch.Tensor  # [Bp] int32
    prefill_block_tables: torch.Tensor  # [Bp, M] int32

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_seq_lens.shape[0])


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, backend: str = "torch") -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self._store = kernel("store_kv", backend)
        self._decode = kernel("decode_attention", backend)
        self._prefill = kernel("prefill_attention", backend)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None

    def bind_kv_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the model runner allocates it")
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        self._store(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        nd = meta.num_decode_tokens
        # one kind of row (every decode step, most prefill steps): the kernel's output is the answer, no copy
        if nd == t:
            return self._decode(q, self.k_cache, self.v_cache, meta.decode_block_tables, meta.decode_seq_lens,
                                self.scale).view(t, self.num_heads * self.head_dim)
        if nd == 0:
            return self._prefill(q, self.k_cache, self.v_cache, meta.prefill_cu_seqlens, meta.prefill_seq_lens,
                                 meta.prefill_block_tables, self.scale).view(t, self.num_heads * self.head_dim)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], self.k_cache, self.v_cache, meta.decode_block_tables,
                                    meta.decode_seq_lens, self.scale)
        if nd < t:
            out[nd:] = self._prefill(q[nd:], self.k_cache, self.v_cache, meta.prefill_cu_seqlens,
                                     meta.prefill_seq_lens, meta.prefill_block_tables, self.scale)
        return out.view(t, self.num_heads * self.head_dim)
