"""The sliding-window KV cache groups' block tables on the device (engine/kv_groups.py), for the decode graphs.

A captured decode graph reads every address from static or persistent device state (executor/cuda_graph.py), so
the host-built tables of an eager step (window_inputs.py) cannot reach it. Here each sliding group keeps a
persistent int32 table [capacity + 1, width] beside the full group's (request_table.py `DeviceBlockTable`), row
for row: a request's row in every group is its `table_row`, row 0 stays all zeros for padding. Entries travel as
deltas in the graph's one upload, like the full table's: a worker's group tables only grow while a request is
live (blocks the engine released stay in them and no query reads them again), so the device lacks only the
tail past `RequestState.windows_on_device`.

Inside the graph, after `DeviceBlockTable.advance` computed the rows' positions and full-group slots, each group's
table is gathered at the graph's width and its slots come from the same positions (slot -1 of a pad row stays
-1): one captured graph serves any set of requests. Eager steps with device state (input_batch.build_inputs) read
the same tables (`step_windows`), so a row's group tables cross the bus once, not every step; only their prefill
rows' slots are built on the host, from the chunk's own positions.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from appliance.executor.input_batch import Stager
from appliance.executor.request_table import (
    ZERO_ROW,
    DeviceBlockTable,
    RequestState,
    scatter_delta,
)
from appliance.layers.attention import WindowTables

if TYPE_CHECKING:
    from appliance.executor.input_batch import Chunk


class WindowDeviceTables:
    """Every sliding group's persistent table, [groups, capacity + 1, width] int32, rows shared with `full`."""

    def __init__(self, groups: int, full: DeviceBlockTable) -> None:
        if groups < 1:
            raise ValueError(f"window device tables need at least one sliding group, got {groups}")
        self.groups, self.width = groups, full.width
        rows = full.capacity + 1
        self.table = torch.zeros(groups, rows, full.width, dtype=torch.int32, device=full.table.device)
        self._dirty = np.zeros((groups, rows), dtype=np.int64)  # columns a previous owner may have left nonzero
        self._no_prefill = torch.zeros(0, 1, dtype=torch.int32, device=full.table.device)
        self._stager = Stager(full.table.device)  # eager steps' deltas and prefill slots

    def delta(self, states: Iterable[RequestState]) -> tuple[np.ndarray, np.ndarray]:
        """(flat index into table, block id), int64, of every group entry the device lacks for these requests;
        marks them written, so the caller must `apply` them before the step's gather."""
        index: list[np.ndarray] = []
        values: list[np.ndarray] = []
        rows, w = self.table.shape[1], self.width
        for s in states:
            if len(s.window_tables) != self.groups:
                raise RuntimeError(f"request {s.request_id!r} has {len(s.window_tables)} sliding-window tables; the "
                                   f"device keeps {self.groups}")
            if not s.windows_on_device:
                s.windows_on_device = [0] * self.groups
            for g, table in enumerate(s.window_tables):
                n, have = len(table), s.windows_on_device[g]
                if n == have:
                    continue
                row = s.table_row
                if row == ZERO_ROW:
                    raise RuntimeError(f"request {s.request_id!r} has no block-table row")
                if n < have or n > w:
                    raise RuntimeError(f"request {s.request_id!r}: sliding group {g + 1}'s table went from {have} to "
                                       f"{n} blocks (it only grows, up to {w} columns)")
                blocks = np.asarray(table[have:n], dtype=np.int64)
                end = n
                if have == 0 and self._dirty[g, row] > n:  # a reused row: clear what its previous owner left
                    end = int(self._dirty[g, row])
                    blocks = np.concatenate([blocks, np.zeros(end - n, np.int64)])
                base = (g * rows + row) * w
                index.append(np.arange(base + have, base + end, dtype=np.int64))
                values.append(blocks)
                self._dirty[g, row] = max(self._dirty[g, row], n)
                s.windows_on_device[g] = n
        if not index:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(index), np.concatenate(values)

    def apply(self, index: torch.Tensor, values: torch.Tensor) -> None:
        scatter_delta(self.table, index, values)

    def decode_windows(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, width: int,
                       block_size: int) -> tuple[WindowTables, ...]:
        """Each group's addresses for one-token rows, computed on the device (capturable: no host sync): the rows'
        tables narrowed to `width` and the slots of their positions; a row whose full-group slot is -1 (padding)
        stores nothing in any group."""
        # every group at once: a model of many groups (Gemma 3's five of eight layers) launches what one does
        tables = self.table[:, :, :width].index_select(1, rows)  # [groups, rows, width]
        group_slots = _slots(tables, positions, slots, block_size)
        return tuple(WindowTables(group_slots[g], tables[g], self._no_prefill) for g in range(self.groups))

    def step_windows(self, decodes: list[Chunk], prefills: list[Chunk], decode_rows: torch.Tensor,
                     prefill_rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, decode_width: int,
                     prefill_width: int, block_size: int) -> tuple[WindowTables, ...]:
        """Each group's addresses for an eager step with device state, in build_inputs' row order: the groups'
        deltas and the prefill rows' slots in one copy; the decode rows' slots (from their device positions and
        full-group slots) and both kinds of table on the device. prefill_rows: the prefill sequences' table rows,
        padding (row 0) included."""
        index, values = self.delta(c.state for c in (*decodes, *prefills))
        k = index.shape[0]
        pre = [_prefill_slots(prefills, g, block_size) for g in range(self.groups)]
        sent = self._stager.send(np.concatenate([index, values, *pre]))
        self.apply(sent[:k], sent[k : 2 * k])
        at, n = 2 * k, pre[0].shape[0]
        dec = self.table[:, :, :decode_width].index_select(1, decode_rows)  # every group at once
        group_slots = torch.cat([_slots(dec, positions, slots, block_size),
                                 sent[at : at + self.groups * n].view(self.groups, n)], dim=1)
        pre_tables = self.table[:, :, :prefill_width].index_select(1, prefill_rows)
        return tuple(WindowTables(group_slots[g], dec[g], pre_tables[g]) for g in range(self.groups))


def _slots(tables: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    """One-token rows' cache slots [groups, rows] from their gathered tables [groups, rows, width] and positions;
    -1 where the full group's slot is -1 (padding)."""
    column = torch.div(positions, block_size, rounding_mode="floor").view(1, -1, 1).expand(tables.shape[0], -1, 1)
    group_slots = tables.gather(2, column).squeeze(2).to(torch.int64) * block_size + positions % block_size
    return torch.where(slots >= 0, group_slots, slots)


def _prefill_slots(prefills: list[Chunk], g: int, block_size: int) -> np.ndarray:
    """Group g's cache slots of the prefill chunks' tokens, from only the blocks the chunks cover."""
    out = [np.zeros(0, np.int64)]
    for c in prefills:
        first, last = c.start // block_size, (c.start + c.num_tokens - 1) // block_size
        blocks = np.asarray(c.state.window_tables[g][first : last + 1], dtype=np.int64)
        pos = np.arange(c.start, c.start + c.num_tokens, dtype=np.int64)
        out.append(blocks[pos // block_size - first] * block_size + pos % block_size)
    return np.concatenate(out)
