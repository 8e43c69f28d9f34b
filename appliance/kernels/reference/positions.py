"""Decode rows' positions, sequence lengths and cache slots from the device-resident per-row lengths.

The oracles of the Triton `decode_positions` and `verify_positions` and their CPU path. Sync-free (no boolean indexing, no `.item()`), so
it also runs on a CUDA device without reading anything back.
"""
from __future__ import annotations

import torch

from appliance.kernels.registry import register


def check_positions_args(rows: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, block_size: int,
                         positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Shape and dtype checks shared by every backend; ValueError naming the disagreement."""
    b = rows.shape[0]
    if rows.dim() != 1 or table.dim() != 2 or lens.shape != (table.shape[0],):
        raise ValueError(f"decode_positions: rows {tuple(rows.shape)} / table {tuple(table.shape)} / lens "
                         f"{tuple(lens.shape)} are not [B] / [R, W] / [R]")
    if positions.shape != (b,) or slots.shape != (b,) or seq_lens.shape != (b,):
        raise ValueError(f"decode_positions: outputs {tuple(positions.shape)} / {tuple(slots.shape)} / "
                         f"{tuple(seq_lens.shape)} do not match {b} rows")
    if lens.dtype != torch.int64 or positions.dtype != torch.int64 or slots.dtype != torch.int64:
        raise ValueError(f"decode_positions: lens, positions and slots must be int64, got {lens.dtype}, "
                         f"{positions.dtype}, {slots.dtype}")
    if seq_lens.dtype != torch.int32 or table.dtype != torch.int32:
        raise ValueError(f"decode_positions: table and seq_lens must be int32, got {table.dtype}, {seq_lens.dtype}")
    if block_size < 1:
        raise ValueError(f"decode_positions: block_size must be >= 1, got {block_size}")


def write_rows(r: torch.Tensor, real: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, block_size: int,
               positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """positions = pos, seq_lens = pos + 1 and the slot of pos in table row r, for real rows (0, 0, -1 for padding
    rows); a block column past the table's width reads block 0."""
    col = pos // block_size
    inside = col < table.shape[1]
    block = torch.where(inside, table[r, col.clamp_max(table.shape[1] - 1)].long(), 0)
    positions.copy_(pos)
    seq_lens.copy_(torch.where(real, pos + 1, 0))
    slots.copy_(torch.where(real, block * block_size + pos % block_size, -1))


@register("decode_positions", "torch")
def decode_positions(rows: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, block_size: int,
                     positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """One-token rows at the next position of their table row, and that position consumed.

    rows[B] (any int dtype): each row's index into the persistent table; 0 is the padding row.
    table[R, W] int32 block ids; lens[R] int64: tokens each table row has computed (row 0 stays 0).
    Writes, for a real row r: positions = lens[r], seq_lens = positions + 1, slots = table[r, p // block_size] *
    block_size + p % block_size, then lens[r] = p + 1; for a padding row: 0, 0, -1 and lens is not touched.
    A block column past W reads block 0 (callers check the tables cover the positions).
    """
    check_positions_args(rows, table, lens, block_size, positions, slots, seq_lens)
    r = rows.long()
    real = r != 0
    pos = torch.where(real, lens.index_select(0, r), 0)
    write_rows(r, real, pos, table, block_size, positions, slots, seq_lens)
    # padding rows write row 0's own value (0) back: the scatter needs no mask and row 0 stays 0
    lens.index_copy_(0, r, torch.where(real, pos + 1, lens[:1].expand_as(pos)))


@register("verify_positions", "torch")
def verify_positions(rows: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor, lens: torch.Tensor,
                     block_size: int, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Rows of multi-token chunks run as decode rows (a verification's): row i at lens[rows[i]] + offsets[i].

    rows[B], table, lens and the outputs as in `decode_positions`; offsets[B] int64: each row's index within its
    chunk. Writes positions, seq_lens = positions + 1 and slots for real rows (0, 0, -1 for padding rows);
    lens is only read (several rows share a table row: the caller moves it once the step's rows are placed).
    """
    check_positions_args(rows, table, lens, block_size, positions, slots, seq_lens)
    if offsets.shape != rows.shape or offsets.dtype != torch.int64:
        raise ValueError(f"verify_positions: offsets {tuple(offsets.shape)} {offsets.dtype} are not [B] int64")
    r = rows.long()
    real = r != 0
    pos = torch.where(real, lens.index_select(0, r) + offsets, 0)
    write_rows(r, real, pos, table, block_size, positions, slots, seq_lens)
