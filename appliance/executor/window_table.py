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
-1): one captured graph serves any set of requests.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from appliance.executor.request_table import ZERO_ROW, DeviceBlockTable, RequestState
from appliance.layers.attention import WindowTables


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
        """One scatter of a delta (already on the device; values int32 or int64)."""
        if index.numel():
            self.table.view(-1).index_copy_(0, index, values.to(torch.int32))

    def decode_windows(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, width: int,
                       block_size: int) -> tuple[WindowTables, ...]:
        """Each group's addresses for one-token rows, computed on the device (capturable: no host sync): the rows'
        tables narrowed to `width` and the slots of their positions; a row whose full-group slot is -1 (padding)
        stores nothing in any group."""
        column = torch.div(positions, block_size, rounding_mode="floor").unsqueeze(1)
        offset = positions % block_size
        out = []
        for g in range(self.groups):
            tables = self.table[g, :, :width].index_select(0, rows)
            group_slots = tables.gather(1, column).squeeze(1).to(torch.int64) * block_size + offset
            out.append(WindowTables(torch.where(slots >= 0, group_slots, slots), tables, self._no_prefill))
        return tuple(out)
