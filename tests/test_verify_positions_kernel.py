"""The `verify_positions` op (kernels/triton/positions.py, its torch reference) and what the verify graphs build on
it (executor/verify_graphs.py `chunk_rows`, request_table.py `place_chunks`): rows of multi-token chunks placed at
lens[row] + offset against a per-row oracle, under the Triton interpreter, and on the GPU inside a captured graph;
the lengths move to each chunk's end. GPU part: python -m pytest -q -m gpu tests/test_verify_positions_kernel.py
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from selfcheck_runner import interpreted_script_rows

from appliance.engine.sampling_params import SamplingParams as Params
from appliance.executor.input_batch import Chunk, graph_stride
from appliance.executor.request_table import ZERO_ROW, DeviceBlockTable, RequestState
from appliance.executor.verify_graphs import chunk_rows
from appliance.kernels.reference.positions import verify_positions as reference

ROOT = Path(__file__).resolve().parents[1]


def random_chunks(seed: int, chunks: int, capacity: int, width: int, block_size: int, pad: int = 3,
                  device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """rows and offsets of `chunks` chunks of 1..5 rows on distinct table rows, then `pad` padding rows; a
    random table (row 0 zeros) and lens that leave each chunk inside its table."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 10_000, (capacity + 1, width), generator=gen, dtype=torch.int32)
    table[ZERO_ROW] = 0
    lens = torch.randint(0, width * block_size - 5, (capacity + 1,), generator=gen)
    lens[ZERO_ROW] = 0
    owners = (torch.randperm(capacity, generator=gen) + 1)[:chunks].tolist()
    rows: list[int] = []
    offsets: list[int] = []
    for r in owners:
        n = int(torch.randint(1, 6, (1,), generator=gen))
        rows += [r] * n
        offsets += range(n)
    rows += [0] * pad
    offsets += [0] * pad
    as_long = {"dtype": torch.int64, "device": device}
    return torch.tensor(rows, **as_long), torch.tensor(offsets, **as_long), table.to(device), lens.to(device)


def oracle(rows: list[int], offsets: list[int], table: list[list[int]], lens: list[int], bs: int
           ) -> tuple[list[int], ...]:
    pos, slots, seq = [], [], []
    for r, j in zip(rows, offsets):
        p = lens[r] + j if r else 0
        pos.append(p)
        seq.append(p + 1 if r else 0)
        slots.append(table[r][p // bs] * bs + p % bs if r else -1)
    return pos, slots, seq


def run(op: Any, rows: torch.Tensor, offsets: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, bs: int
        ) -> tuple[torch.Tensor, ...]:
    n = rows.shape[0]
    pos = torch.full((n,), 7, dtype=torch.int64, device=rows.device)
    slots = torch.full((n,), 7, dtype=torch.int64, device=rows.device)
    seq = torch.full((n,), 7, dtype=torch.int32, device=rows.device)
    op(rows, offsets, table, lens, bs, pos, slots, seq)
    return pos, slots, seq


@pytest.mark.parametrize(("seed", "chunks", "bs"), [(0, 1, 16), (1, 7, 4), (2, 40, 1), (3, 60, 16)])
def test_reference_matches_a_per_row_oracle(seed: int, chunks: int, bs: int) -> None:
    rows, offsets, table, lens = random_chunks(seed, chunks, 128, 9, bs)
    before = lens.clone()
    got = run(reference, rows, offsets, table, lens, bs)
    assert tuple(t.tolist() for t in got) == oracle(rows.tolist(), offsets.tolist(), table.tolist(), lens.tolist(), bs)
    assert torch.equal(lens, before)  # only read


def test_bad_offsets_are_refused() -> None:
    rows, offsets, table, lens = random_chunks(4, 3, 8, 4, 4)
    with pytest.raises(ValueError, match="offsets"):
        run(reference, rows, offsets.int(), table, lens, 4)


def test_place_chunks_moves_each_length_to_its_chunk_end() -> None:
    table = DeviceBlockTable(8, 6, torch.device("cpu"), "torch")
    rows, offsets, _, _ = random_chunks(5, 5, 8, 6, 4, pad=4)
    table.table[1:, :6] = torch.arange(1, 49, dtype=torch.int32).view(8, 6)
    table.lens[1:] = torch.tensor([3, 0, 9, 4, 7, 1, 2, 8])
    start = table.lens.clone()
    n = rows.shape[0]
    pos, slots = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
    seq = torch.zeros(n, dtype=torch.int32)
    # rows in a shuffled order: the end must not depend on which row comes last
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(6))
    table.place_chunks(rows[perm], offsets[perm], 4, pos, slots, seq)
    want = start.clone()
    for r, j in zip(rows.tolist(), offsets.tolist()):
        if r:
            want[r] = max(int(want[r]), int(start[r]) + j + 1)
    assert table.lens.tolist() == want.tolist() and table.lens[ZERO_ROW] == 0
    assert pos.tolist() == [int(start[r]) + j if r else 0 for r, j in zip(rows[perm].tolist(), offsets[perm].tolist())]


def test_chunk_rows_layout() -> None:
    a = RequestState("a", [1, 2, 3, 4, 5, 6], 3, 3, [7, 9], Params(), table_row=2)
    b = RequestState("b", [8, 8, 8, 8, 4], 4, 4, [5, 6], Params(), table_row=1)
    out = np.full(3 * graph_stride(8) + 3, 99, dtype=np.int64)
    chunk_rows([Chunk(a, 3, 3, True), Chunk(b, 4, 1, True)], 4, 8, out)
    v = out[: 3 * 8].reshape(3, 8)
    assert v[0].tolist() == [4, 5, 6, 4, 0, 0, 0, 0]  # token ids, then padding
    assert v[1].tolist() == [2, 2, 2, 1, 0, 0, 0, 0]  # table rows (0: the zero row)
    assert v[2].tolist() == [0, 1, 2, 0, 0, 0, 0, 0]  # offsets within each chunk
    assert out[3 * 8 :].tolist() == [99, 99, 99]
    with pytest.raises(RuntimeError, match="exceed"):
        chunk_rows([Chunk(a, 3, 6, True)], 4, 8, out)


_INTERPRETED = r"""
import json, torch
from test_verify_positions_kernel import random_chunks, run
from appliance.kernels.registry import get
import appliance.kernels.reference.positions, appliance.kernels.triton.positions
fast, ref = get("verify_positions", "triton"), get("verify_positions", "torch")
for seed, chunks, cap, width, bs in [(0, 1, 4, 2, 16), (1, 9, 30, 5, 4), (2, 90, 100, 3, 8), (3, 5, 8, 2, 4)]:
    rows, offsets, table, lens = random_chunks(seed, chunks, cap, width, bs)
    a, b = lens.clone(), lens.clone()
    got, want = run(fast, rows, offsets, table, a, bs), run(ref, rows, offsets, table, b, bs)
    same = all(torch.equal(x, y) for x, y in zip(got + (a,), want + (b,)))
    print(json.dumps({"case": seed, "rows": rows.shape[0], "same": same}))
"""


def test_triton_kernel_matches_the_reference_interpreted() -> None:
    pytest.importorskip("triton")
    rows = interpreted_script_rows(_INTERPRETED, timeout=240)
    assert [r["case"] for r in rows] == [0, 1, 2, 3]
    assert max(r["rows"] for r in rows) > 128  # several programs
    assert all(r["same"] for r in rows), rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_matches_the_reference_on_gpu_and_in_a_graph() -> None:
    import appliance.kernels.triton.positions  # noqa: F401
    from appliance.kernels.registry import get

    fast = get("verify_positions", "triton")
    for seed, chunks, bs in ((0, 1, 16), (1, 40, 16), (2, 100, 4)):
        rows, offsets, table, lens = random_chunks(seed, chunks, 512, 64, bs, device="cuda")
        got, want = run(fast, rows, offsets, table, lens, bs), run(reference, rows, offsets, table, lens, bs)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    rows, offsets, table, lens = random_chunks(3, 16, 64, 8, 16, device="cuda")
    outs = [torch.zeros_like(rows), torch.zeros_like(rows), torch.zeros(rows.shape[0], dtype=torch.int32,
                                                                         device="cuda")]
    fast(rows, offsets, table, lens, 16, *outs)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fast(rows, offsets, table, lens, 16, *outs)
    for k in range(3):  # each replay reads the lengths as they are now
        lens.add_(k)
        graph.replay()
        want = run(reference, rows, offsets, table, lens, 16)
        assert all(torch.equal(x, y) for x, y in zip(outs, want))
