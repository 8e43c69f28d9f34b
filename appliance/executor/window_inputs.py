"""The sliding-window KV cache groups' addresses of one step (engine/kv_groups.py): each group's cache slot of
every row and the block tables of its decode and prefill rows, built on the host from the requests' group tables
(request_table.py `RequestState.window_tables`) in the row order of input_batch.py's `build_inputs`, for steps
without device state (the warm-up's, profiling); the runner's steps read the device tables (window_table.py).

A group's table covers the same positions as the full one; entries before a request's window are the group's
null block or blocks the engine released (which other requests may own now): the window's kernels read no key
there, so whatever those blocks hold is masked out.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from appliance.layers.attention import WindowTables

if TYPE_CHECKING:
    from appliance.executor.input_batch import Chunk


def window_tables(decodes: list[Chunk], prefills: list[Chunk], num_pad_prefills: int, decode_width: int,
                  prefill_width: int, block_size: int, device: torch.device) -> tuple[WindowTables, ...]:
    """One WindowTables per sliding group, () when the requests have none (a model of one group). Padding
    prefill sequences read all-zero table rows, like the full group's."""
    first = (decodes or prefills)[0] if decodes or prefills else None
    if first is None or not first.state.window_tables:
        return ()
    out = []
    for g in range(len(first.state.window_tables)):
        slots = [np.zeros(0, np.int64)]
        dec = np.zeros((len(decodes), decode_width), np.int32)
        for i, c in enumerate(decodes):
            table = np.asarray(c.state.window_tables[g], np.int64)
            slots.append(table[c.start // block_size: c.start // block_size + 1] * block_size + c.start % block_size)
            dec[i, : table.shape[0]] = table
        pre = np.zeros((len(prefills) + num_pad_prefills, prefill_width), np.int32)
        for i, c in enumerate(prefills):
            table = np.asarray(c.state.window_tables[g], np.int64)
            pos = np.arange(c.start, c.start + c.num_tokens, dtype=np.int64)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            pre[i, : table.shape[0]] = table
        out.append(WindowTables(torch.from_numpy(np.concatenate(slots)).to(device),
                                torch.from_numpy(dec).to(device), torch.from_numpy(pre).to(device)))
    return tuple(out)
