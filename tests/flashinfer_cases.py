"""Inputs and checks for the flashinfer backend's tests, shared by the CPU glue tests (tests/test_flashinfer_backend.py,
over the stand-in) and the GPU tests (tests/test_flashinfer_gpu.py, over the real kernels): random paged caches,
each op's case against the torch reference, and a mixed decode + prefill step through `Attention`."""
from __future__ import annotations

import numpy as np
import torch

from appliance.kernels import registry
from appliance.layers.attention import Attention, AttentionMetadata


def paged_kv(seq_lens: list[int], block_size: int, hkv: int, d: int, dtype: torch.dtype, device: str, seed: int = 0,
             spare_cols: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random caches, each sequence on a random set of blocks; block table rows padded with 0 (a real block)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [(n + block_size - 1) // block_size for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    k = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype).to(device)
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(per_seq, default=0) + spare_cols, dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
    return k, v, table.to(device)


def check_close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)).item()
    assert err <= tol, f"relative error {err:.3g} > {tol}"


def decode_case(batch_lens: list[int], h: int, hkv: int, d: int, dtype: torch.dtype, device: str,
                tol: float, seed: int = 0) -> None:
    k, v, table = paged_kv(batch_lens, 16, hkv, d, dtype, device, seed)
    q = torch.randn(len(batch_lens), h, d, generator=torch.Generator().manual_seed(seed + 1)).to(dtype).to(device)
    lens = torch.tensor(batch_lens, dtype=torch.int32, device=device)
    args = (q, k, v, table, lens, d**-0.5)
    check_close(registry.get("decode_attention", "flashinfer")(*args), registry.get("decode_attention", "torch")(*args),
                tol)


def prefill_case(q_lens: list[int], prefixes: list[int], h: int, hkv: int, d: int, dtype: torch.dtype, device: str,
                 tol: float, seed: int = 0) -> None:
    """Sequences of q_lens new rows over cached prefixes; empty trailing sequences like the runner's padding."""
    seq = [p + n for p, n in zip(prefixes, q_lens)]
    k, v, table = paged_kv([max(s, 1) for s in seq], 16, hkv, d, dtype, device, seed)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32, device=device)
    q = torch.randn(sum(q_lens), h, d, generator=torch.Generator().manual_seed(seed + 2)).to(dtype).to(device)
    lens = torch.tensor(seq, dtype=torch.int32, device=device)
    args = (q, k, v, cu, lens, table, d**-0.5)
    check_close(registry.get("prefill_attention", "flashinfer")(*args),
                registry.get("prefill_attention", "torch")(*args), tol)


def store_case(n: int, hkv: int, d: int, dtype: torch.dtype, device: str, skip_every: int = 0, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    blocks, block_size = 9, 16
    base = torch.randn(blocks, block_size, hkv, d, generator=gen).to(dtype).to(device)
    key, value = (torch.randn(n, hkv, d, generator=gen).to(dtype).to(device) for _ in range(2))
    slots = torch.randperm(blocks * block_size, generator=gen)[:n]
    if skip_every:
        slots[::skip_every] = -1
    slots = slots.to(device)
    caches = {b: (base.clone(), base.clone() * 2) for b in ("flashinfer", "torch")}
    for b, (kc, vc) in caches.items():
        registry.get("store_kv", b)(key, value, kc, vc, slots)
    assert torch.equal(caches["flashinfer"][0], caches["torch"][0])
    assert torch.equal(caches["flashinfer"][1], caches["torch"][1])


def mixed_step(backend: str, dtype: torch.dtype, device: str, layers: int = 3,
               d: int = 64) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`layers` Attention layers over one step of 2 decodes + 2 prefill chunks (one over a cached prefix) + one
    empty padding sequence, all sharing one AttentionMetadata; returns each layer's output and the first k cache."""
    h, hkv, block_size = 8, 2, 16
    gen = torch.Generator().manual_seed(7)
    dec_lens, pre_q, pre_prefix = [21, 40], [5, 17, 0], [30, 0, 0]
    pre_seq = [p + q for p, q in zip(pre_prefix, pre_q)]
    blocks = 16
    perm = torch.randperm(blocks, generator=gen).tolist()
    rows = [perm[0:2], perm[2:5], perm[5:8], perm[8:10], [0]]  # 2 decode rows, 3 prefill rows (last: padding)
    table = torch.zeros(5, 4, dtype=torch.int32)
    for r, ids in enumerate(rows):
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    positions = [n - 1 for n in dec_lens] + [p + j for p, q in zip(pre_prefix, pre_q) for j in range(q)]
    owners = [0, 1] + [2 + b for b, q in enumerate(pre_q) for _ in range(q)]
    slots = torch.tensor([table[o, p // block_size].item() * block_size + p % block_size
                          for o, p in zip(owners, positions)])
    t = len(positions)
    meta = AttentionMetadata(
        slot_mapping=slots.to(device), num_decode_tokens=2, decode_block_tables=table[:2].to(device),
        decode_seq_lens=torch.tensor(dec_lens, dtype=torch.int32, device=device),
        prefill_cu_seqlens=torch.tensor([0, 5, 22, 22], dtype=torch.int32, device=device),
        prefill_seq_lens=torch.tensor(pre_seq, dtype=torch.int32, device=device),
        prefill_block_tables=table[2:].to(device))
    outs, first_cache = [], None
    for layer in range(layers):
        lgen = torch.Generator().manual_seed(100 + layer)
        kc = torch.randn(blocks, block_size, hkv, d, generator=lgen).to(dtype).to(device)
        vc = torch.randn(blocks, block_size, hkv, d, generator=lgen).to(dtype).to(device)
        q, k, v = (torch.randn(t, n * d, generator=lgen).to(dtype).to(device) for n in (h, hkv, hkv))
        attn = Attention(h, d, hkv, d**-0.5, backend)
        attn.bind_kv_cache(kc, vc)
        outs.append(attn(q, k, v, meta))
        first_cache = kc if first_cache is None else first_cache
    return outs, first_cache
