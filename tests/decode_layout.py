"""The host-built layout of a decode graph's inputs: the oracle the device-computed inputs are tested against
(executor/cuda_graph.py and kernels/*/positions.py compute them on the device; no step builds this)."""
from __future__ import annotations

import numpy as np

from appliance.executor.input_batch import Chunk, decode_rows, graph_stride, table_width


def build_decode_arrays(decodes: list[Chunk], block_size: int, batch: int, width: int, out64: np.ndarray) -> None:
    """out64 = [ids | positions | slots | seq_lens | table rows], five segments of graph_stride(batch); pad rows:
    token 0 at position 0, slot -1, seq_len 0, table row 0."""
    n = len(decodes)
    if n > batch or table_width(decodes) > width:
        raise ValueError(f"{n} decode rows / width {table_width(decodes)} do not fit a graph of {batch} x {width}")
    ids, pos, slots, rows = decode_rows(decodes, block_size)
    stride = graph_stride(batch)
    v = out64[: 5 * stride].reshape(5, stride)
    v[0, :n], v[1, :n], v[2, :n], v[3, :n], v[4, :n] = ids, pos, slots, pos + 1, rows
    v[:, n:] = 0
    v[2, n:] = -1
