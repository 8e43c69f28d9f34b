"""Random inputs of the paged-KV ops (store_kv, decode_attention, prefill_attention) and the sliding-window and
attention-sink cases: caches with a random permutation of blocks, so wrong block indexing cannot pass."""
from __future__ import annotations

from typing import Any

import torch

from appliance.kernels.triton.selfcheck_case import Case, Inputs


def _paged_kv(seq_lens: list[int], block_size: int, hkv: int, d: int, dtype: torch.dtype, device: str,
              gen: torch.Generator, extra_cols: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Caches with a random block layout; block table padded with 0 past each sequence's blocks."""
    per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(per_seq) + 1
    k = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(device)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(per_seq) + extra_cols, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return k, v, table.to(device)


def decode_inputs(batch: int, heads: int, kv_heads: int, head_dim: int, block_size: int, seq_lens: list[int],
                  dtype: torch.dtype, device: str, seed: int = 0, num_splits: int | None = None,
                  longest_first: bool = False, sliding_window: int | None = None, sinks: bool = False) -> Inputs:
    """`longest_first`: the kernel takes the rows in the order the runner gives it on large batches.
    `sliding_window`, `sinks`: the op's window and (random) per-head sink logits."""
    gen = torch.Generator().manual_seed(seed)
    k, v, table = _paged_kv(seq_lens, block_size, kv_heads, head_dim, dtype, device, gen)
    q = torch.randn(batch, heads, head_dim, generator=gen).to(dtype).to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    kv_bytes = 2 * sum(seq_lens) * kv_heads * head_dim * k.element_size()
    extra: tuple[tuple[str, Any], ...] = (("num_splits", num_splits),) if num_splits else ()
    if longest_first:
        extra += (("order", torch.argsort(lens, descending=True)),)
    return Inputs((q, k, v, table, lens, head_dim**-0.5), kv_bytes + 2 * q.numel() * q.element_size(), extra,
                  _window_sinks(sliding_window, sinks, heads, gen, device))


def _window_sinks(sliding_window: int | None, sinks: bool, heads: int, gen: torch.Generator,
                  device: str) -> tuple[tuple[str, Any], ...]:
    kwargs: tuple[tuple[str, Any], ...] = (("sliding_window", sliding_window),) if sliding_window else ()
    if sinks:  # float32 like a checkpoint's sinks in any model dtype; large enough to take real mass
        kwargs += (("sinks", (2 * torch.randn(heads, generator=gen)).to(device)),)
    return kwargs


def prefill_inputs(q_lens: list[int], prefix_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                   block_size: int, dtype: torch.dtype, device: str, seed: int = 0, sliding_window: int | None = None,
                   sinks: bool = False) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + n for p, n in zip(prefix_lens, q_lens)]
    k, v, table = _paged_kv(seq_lens, block_size, kv_heads, head_dim, dtype, device, gen)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype).to(device)
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    kv_bytes = 2 * sum(seq_lens) * kv_heads * head_dim * k.element_size()
    return Inputs((q, k, v, cu, lens, table, head_dim**-0.5), kv_bytes + 2 * q.numel() * q.element_size(),
                  kwargs=_window_sinks(sliding_window, sinks, heads, gen, device))


def store_kv_inputs(tokens: int, kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype, device: str,
                    seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    num_blocks = (tokens + block_size - 1) // block_size + 2
    key = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    value = torch.randn(tokens, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::7] = -1  # padding tokens are skipped
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype).to(device)
    return Inputs((key, value, k_cache, v_cache, slots.to(device)), 4 * key.numel() * key.element_size())


def window_sink_cases(d: str) -> list[Case]:
    """Sliding windows shorter and longer than the context, attention sinks, both together, on every decode path
    (unsplit, split-K with its merge, one-tile splits) and the prefill's (prefix, long prefix, empty sequence)."""
    bf, f32 = torch.bfloat16, torch.float32
    return [
        ("decode_attention", "f32-window20", lambda: decode_inputs(4, 4, 2, 64, 16, [37, 1, 100, 0], f32, d,
                                                                   sliding_window=20)),
        ("decode_attention", "bf16-sinks", lambda: decode_inputs(3, 8, 2, 64, 16, [1, 37, 100], bf, d, sinks=True)),
        ("decode_attention", "f32-window70-sinks-splitk3", lambda: decode_inputs(
            3, 4, 2, 64, 16, [300, 1, 130], f32, d, num_splits=3, sliding_window=70, sinks=True)),
        ("decode_attention", "bf16-window5-sinks-one-tile-splits", lambda: decode_inputs(
            4, 4, 2, 64, 16, [0, 65, 64, 130], bf, d, num_splits=3, sliding_window=5, sinks=True)),
        ("prefill_attention", "f32-window10-prefix", lambda: prefill_inputs([5, 1, 70], [0, 20, 33], 4, 2, 64, 16,
                                                                            f32, d, sliding_window=10)),
        ("prefill_attention", "bf16-window70-sinks-long-prefix", lambda: prefill_inputs(
            [20, 70], [130, 64], 2, 1, 64, 16, bf, d, sliding_window=70, sinks=True)),
        ("prefill_attention", "f32-sinks-empty-seq", lambda: prefill_inputs([3, 0, 17], [4, 9, 0], 2, 1, 64, 8,
                                                                            f32, d, sinks=True)),
        ("prefill_attention", "f32-window1", lambda: prefill_inputs([9], [7], 2, 2, 64, 16, f32, d,
                                                                    sliding_window=1)),
    ]
