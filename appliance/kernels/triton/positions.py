"""Decode rows' positions, sequence lengths and cache slots from the device-resident per-row lengths, in one launch
(`decode_positions`: one-token rows, advancing the lengths; `verify_positions`: rows of multi-token chunks at an
offset from their row's length, which they only read).

Replaces the per-step host computation and upload of [positions | slots | seq_lens] of one-token rows: the
worker keeps each table row's computed length on the device (executor/request_table.py) and this kernel reads
it, writes the step's inputs and advances it. It runs inside the captured decode graphs (no host sync).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.reference.positions import check_positions_args
from appliance.kernels.registry import register

BLOCK_R = 128


@triton.jit(do_not_specialize=["n"])  # one variant for every row count (graphs and eager steps alike)
def _decode_positions_kernel(rows_ptr, table_ptr, lens_ptr, pos_ptr, slots_ptr, seq_lens_ptr, n, width, stride,
                             BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = offs < n
    row = tl.load(rows_ptr + offs, mask=inside, other=0).to(tl.int64)
    real = inside & (row != 0)
    pos = tl.load(lens_ptr + row, mask=real, other=0)
    col = pos // BLOCK_SIZE
    block = tl.load(table_ptr + row * stride + col, mask=real & (col < width), other=0).to(tl.int64)
    tl.store(pos_ptr + offs, pos, mask=inside)
    tl.store(seq_lens_ptr + offs, tl.where(real, pos + 1, 0).to(tl.int32), mask=inside)
    tl.store(slots_ptr + offs, tl.where(real, block * BLOCK_SIZE + pos % BLOCK_SIZE, -1), mask=inside)
    tl.store(lens_ptr + row, pos + 1, mask=real)  # a request owns one row, so no two programs race on it


@register("decode_positions", "triton")
def decode_positions(rows: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, block_size: int,
                     positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Same contract as the torch reference (kernels/reference/positions.py)."""
    check_positions_args(rows, table, lens, block_size, positions, slots, seq_lens)
    if table.stride(1) != 1 or any(x.stride(0) != 1 for x in (rows, lens, positions, slots, seq_lens)):
        raise ValueError("decode_positions: the table's rows and every vector must be contiguous")
    n = rows.shape[0]
    if n:
        _decode_positions_kernel[(triton.cdiv(n, BLOCK_R),)](rows, table, lens, positions, slots, seq_lens, n,
                                                           table.shape[1], table.stride(0), BLOCK_SIZE=block_size,
                                                           BLOCK_R=BLOCK_R, num_warps=4)


@triton.jit(do_not_specialize=["n"])
def _verify_positions_kernel(rows_ptr, offsets_ptr, table_ptr, lens_ptr, pos_ptr, slots_ptr, seq_lens_ptr, n, width,
                             stride, BLOCK_SIZE: tl.constexpr, BLOCK_R: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    inside = offs < n
    row = tl.load(rows_ptr + offs, mask=inside, other=0).to(tl.int64)
    real = inside & (row != 0)
    pos = tl.load(lens_ptr + row, mask=real, other=0) + tl.load(offsets_ptr + offs, mask=real, other=0)
    col = pos // BLOCK_SIZE
    block = tl.load(table_ptr + row * stride + col, mask=real & (col < width), other=0).to(tl.int64)
    tl.store(pos_ptr + offs, pos, mask=inside)
    tl.store(seq_lens_ptr + offs, tl.where(real, pos + 1, 0).to(tl.int32), mask=inside)
    tl.store(slots_ptr + offs, tl.where(real, block * BLOCK_SIZE + pos % BLOCK_SIZE, -1), mask=inside)


@register("verify_positions", "triton")
def verify_positions(rows: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                     block_size: int, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Same contract as the torch reference (kernels/reference/positions.py)."""
    check_positions_args(rows, table, lens, block_size, positions, slots, seq_lens)
    if offsets.shape != rows.shape or offsets.dtype != torch.int64:
        raise ValueError(f"verify_positions: offsets {tuple(offsets.shape)} {offsets.dtype} are not [B] int64")
    if table.stride(1) != 1 or any(x.stride(0) != 1 for x in (rows, offsets, lens, positions, slots, seq_lens)):
        raise ValueError("verify_positions: the table's rows and every vector must be contiguous")
    n = rows.shape[0]
    if n:
        _verify_positions_kernel[(triton.cdiv(n, BLOCK_R),)](rows, offsets, table, lens, positions, slots, seq_lens,
                                                           n, table.shape[1], table.stride(0), BLOCK_SIZE=block_size,
                                                           BLOCK_R=BLOCK_R, num_warps=4)
