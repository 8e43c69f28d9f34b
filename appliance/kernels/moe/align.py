"""The fused MoE's expert sort: the T*K (token, slot) pairs grouped by expert, each expert's run padded to whole
BLOCK_M tiles, and every tile's expert (kernels/moe/triton_moe.py runs one program per tile).

`align_blocks` is four Triton launches (count each block of pairs per expert; scan those counts per expert over
the blocks; one program finds each expert's first slot and each tile's expert; place every pair), where the torch
version (`align_blocks_torch`, the oracle) issues about 25 small ops: in a prefill step of a few thousand tokens
the host time of issuing them, per MoE layer, exceeded their device time. Both are stable (an expert's pairs keep their
order), so both give the same tensors; neither syncs with the host, and buffer sizes depend on T, K and E only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_PAIRS = 128  # pairs per program of the count and place kernels (the place kernel compares them all pairwise)
_EXPERTS = 64  # experts per step of the count kernel, per program of the scan kernel
_BLOCKS = 32  # blocks of pairs per step of the scan kernel
_TILES = 64  # tiles per step of the tiles kernel


def capacity(pairs: int, num_experts: int, block_m: int) -> int:
    """Slots of sorted_ids: every expert's run padded to whole tiles, at worst."""
    cap = pairs + num_experts * (block_m - 1)
    return (cap + block_m - 1) // block_m * block_m


def align_blocks_torch(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [cap] int32: flat (token*K + slot) indices grouped by expert, sentinel T*K as padding;
    block_experts [cap / block_m] int32: each tile's expert, -1 for tiles past the used length)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    m = flat.numel()
    cap = capacity(m, num_experts, block_m)
    # scatter_add, not bincount: bincount reads the largest id on the host (a sync a CUDA graph cannot hold)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(m, device=flat.device) - first_of_expert[experts_sorted]
    dest = (ends - padded)[experts_sorted] + rank
    sorted_ids = torch.full((cap,), m, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_start = torch.arange(0, cap, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, tile_start, right=True).to(torch.int32)
    block_experts = torch.where(tile_start < ends[-1], block_experts, torch.full_like(block_experts, -1))
    return sorted_ids, block_experts


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, pairs, num_experts, PAIRS: tl.constexpr, EXPERTS: tl.constexpr):
    """counts[b, e]: pairs of block b routed to expert e."""
    b = tl.program_id(0)
    offs = b * PAIRS + tl.arange(0, PAIRS)
    ids = tl.load(ids_ptr + offs, mask=offs < pairs, other=-1).to(tl.int32)
    for e0 in range(0, num_experts, EXPERTS):
        experts = e0 + tl.arange(0, EXPERTS)
        counts = tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
        tl.store(counts_ptr + b * num_experts + experts, counts, mask=experts < num_experts)


@triton.jit
def _scan_kernel(counts_ptr, totals_ptr, num_experts, blocks, EXPERTS: tl.constexpr, BLOCKS: tl.constexpr):
    """Per expert of this program's share: counts[b, e] becomes the pairs of expert e in blocks before b, and
    totals[e] all of them."""
    experts = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    emask = experts < num_experts
    total = tl.zeros([EXPERTS], tl.int32)
    for b0 in range(0, blocks, BLOCKS):
        rows = b0 + tl.arange(0, BLOCKS)
        ptrs = counts_ptr + rows[:, None] * num_experts + experts[None, :]
        mask = (rows < blocks)[:, None] & emask[None, :]
        c = tl.load(ptrs, mask=mask, other=0)
        inclusive = tl.cumsum(c, axis=0)
        tl.store(ptrs, total[None, :] + inclusive - c, mask=mask)
        total += tl.sum(c, axis=0)
    tl.store(totals_ptr + experts, total, mask=emask)


@triton.jit
def _tiles_kernel(totals_ptr, starts_ptr, sorted_ptr, tiles_ptr, pairs, num_experts, cap, BLOCK_E: tl.constexpr,
                  BLOCK_M: tl.constexpr, TILES: tl.constexpr):
    """One program: each expert's first slot (runs padded to whole tiles), each tile's expert (-1 past the used
    tiles), and the sentinel in every slot (the place kernel then writes the pairs' slots)."""
    experts = tl.arange(0, BLOCK_E)
    emask = experts < num_experts
    total = tl.load(totals_ptr + experts, mask=emask, other=0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(starts_ptr + experts, ends - padded, mask=emask)
    used = tl.sum(padded, 0)
    ends = tl.where(emask, ends, 2147483647)
    sentinel = tl.full([TILES, BLOCK_M], 0, tl.int32) + pairs
    for t0 in range(0, cap // BLOCK_M, TILES):
        first = (t0 + tl.arange(0, TILES)) * BLOCK_M
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)  # searchsorted(ends, right=True)
        tl.store(tiles_ptr + first // BLOCK_M, tl.where(first < used, expert, -1), mask=first < cap)
        slots = first[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + slots, sentinel, mask=slots < cap)


@triton.jit
def _place_kernel(ids_ptr, counts_ptr, starts_ptr, sorted_ptr, pairs, num_experts, PAIRS: tl.constexpr):
    """Each pair's slot: its expert's start, the pairs of that expert in earlier blocks, then earlier in its own."""
    b = tl.program_id(0)
    local = tl.arange(0, PAIRS)
    offs = b * PAIRS + local
    mask = offs < pairs
    ids = tl.load(ids_ptr + offs, mask=mask, other=-1).to(tl.int32)
    before = (ids[:, None] == ids[None, :]) & (local[:, None] < local[None, :])  # [i, j]: i precedes j
    rank = tl.sum(before.to(tl.int32), axis=0)
    safe = tl.where(mask, ids, 0)
    base = tl.load(starts_ptr + safe, mask=mask, other=0) + tl.load(counts_ptr + b * num_experts + safe, mask=mask,
                                                                    other=0)
    tl.store(sorted_ptr + base + rank, offs.to(tl.int32), mask=mask)


def align_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_blocks_torch's result in four launches."""
    flat = topk_ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    m = flat.numel()
    cap = capacity(m, num_experts, block_m)
    blocks = max(1, triton.cdiv(m, _PAIRS))
    device = flat.device
    counts = torch.empty(blocks, num_experts, dtype=torch.int32, device=device)
    totals, starts = torch.empty(2, num_experts, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(cap, dtype=torch.int32, device=device)
    block_experts = torch.empty(cap // block_m, dtype=torch.int32, device=device)
    _count_kernel[(blocks,)](flat, counts, m, num_experts, PAIRS=_PAIRS, EXPERTS=_EXPERTS)
    _scan_kernel[(triton.cdiv(num_experts, _EXPERTS),)](counts, totals, num_experts, blocks, EXPERTS=_EXPERTS,
                                                        BLOCKS=_BLOCKS)
    _tiles_kernel[(1,)](totals, starts, sorted_ids, block_experts, m, num_experts, cap,
                        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_M=block_m, TILES=_TILES)
    _place_kernel[(blocks,)](flat, counts, starts, sorted_ids, m, num_experts, PAIRS=_PAIRS)
    return sorted_ids, block_experts
