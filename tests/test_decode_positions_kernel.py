"""The `decode_positions` op (kernels/triton/positions.py, its torch reference): positions, slots and seq_lens
of decode rows from the device-resident lengths, against a per-row oracle, under the Triton interpreter, and on
the GPU inside a captured graph. The state around it is tested in tests/test_device_positions.py."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from selfcheck_runner import interpreted_script_rows

from appliance.executor.request_table import ZERO_ROW
from appliance.kernels.reference.positions import decode_positions as reference

ROOT = Path(__file__).resolve().parents[1]


def _random_case(seed: int, batch: int, capacity: int, width: int, block_size: int, device: str = "cpu"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows (distinct real rows, every third a pad row), a table of random block ids (row 0 zeros) and lens
    that stay inside each row's table."""
    gen = torch.Generator().manual_seed(seed)
    table = torch.randint(1, 10_000, (capacity + 1, width), generator=gen, dtype=torch.int32)
    table[ZERO_ROW] = 0
    lens = torch.randint(0, width * block_size, (capacity + 1,), generator=gen)
    lens[ZERO_ROW] = 0
    real = (torch.randperm(capacity, generator=gen) + 1)[:batch]
    rows = torch.where(torch.arange(batch) % 3 == 1, 0, real)
    return rows.to(device), table.to(device), lens.to(device)


def _oracle(rows: list[int], table: list[list[int]], lens: list[int], bs: int) -> tuple[list[int], ...]:
    pos, slots, seq, after = [], [], [], list(lens)
    for r in rows:
        p = lens[r] if r else 0
        pos.append(p)
        seq.append(p + 1 if r else 0)
        slots.append(table[r][p // bs] * bs + p % bs if r else -1)
        if r:
            after[r] = p + 1
    return pos, slots, seq, after


def _run(op: Any, rows: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, bs: int) -> tuple[torch.Tensor, ...]:
    n = rows.shape[0]
    pos = torch.full((n,), 7, dtype=torch.int64, device=rows.device)
    slots = torch.full((n,), 7, dtype=torch.int64, device=rows.device)
    seq = torch.full((n,), 7, dtype=torch.int32, device=rows.device)
    op(rows, table, lens, bs, pos, slots, seq)
    return pos, slots, seq


@pytest.mark.parametrize(("seed", "batch", "bs"), [(0, 1, 16), (1, 7, 4), (2, 40, 1), (3, 200, 16)])
def test_reference_matches_a_per_row_oracle(seed: int, batch: int, bs: int) -> None:
    rows, table, lens = _random_case(seed, batch, 256, 9, bs)
    want = _oracle(rows.tolist(), table.tolist(), lens.tolist(), bs)
    for dtype in (torch.int64, torch.int32):  # graphs send int64 rows; any int dtype is accepted
        got_lens = lens.clone()
        pos, slots, seq = _run(reference, rows.to(dtype), table, got_lens, bs)
        assert (pos.tolist(), slots.tolist(), seq.tolist(), got_lens.tolist()) == want
    assert seq.dtype == torch.int32 and got_lens[ZERO_ROW] == 0


def test_all_padding_leaves_the_lengths_alone() -> None:
    """What warm-up and graph capture run: lens must not change (nor row 0)."""
    _, table, lens = _random_case(4, 8, 16, 4, 4)
    before = lens.clone()
    pos, slots, seq = _run(reference, torch.zeros(8, dtype=torch.int64), table, lens, 4)
    assert torch.equal(lens, before)
    assert pos.tolist() == [0] * 8 and slots.tolist() == [-1] * 8 and seq.tolist() == [0] * 8


def test_bad_arguments_are_refused() -> None:
    rows, table, lens = _random_case(5, 4, 8, 4, 4)
    with pytest.raises(ValueError, match="int64"):
        _run(reference, rows, table, lens.int(), 4)
    with pytest.raises(ValueError, match="int32"):
        _run(reference, rows, table.long(), lens, 4)
    with pytest.raises(ValueError, match="do not match"):
        reference(rows, table, lens, 4, *(torch.zeros(3, dtype=d) for d in (torch.int64, torch.int64, torch.int32)))


_INTERPRETED = r"""
import json, torch
from test_decode_positions_kernel import _random_case, _run
from appliance.kernels.registry import get
import appliance.kernels.reference.positions, appliance.kernels.triton.positions
fast, ref = get("decode_positions", "triton"), get("decode_positions", "torch")
for seed, batch, cap, width, bs, dtype in [(0, 1, 4, 2, 16, torch.int64), (1, 9, 30, 5, 4, torch.int32),
                                           (2, 300, 400, 3, 8, torch.int64), (3, 5, 8, 1, 1, torch.int64)]:
    rows, table, lens = _random_case(seed, batch, cap, width, bs)
    a, b = lens.clone(), lens.clone()
    got, want = _run(fast, rows.to(dtype), table, a, bs), _run(ref, rows, table, b, bs)
    same = all(torch.equal(x, y) for x, y in zip(got + (a,), want + (b,)))
    print(json.dumps({"case": seed, "same": same, "dtypes": [str(x.dtype) for x in got]}))
"""


def test_triton_kernel_matches_the_reference_interpreted() -> None:
    pytest.importorskip("triton")
    rows = interpreted_script_rows(_INTERPRETED, timeout=240)
    assert [r["case"] for r in rows] == [0, 1, 2, 3]  # 300 rows: several programs
    assert all(r["same"] for r in rows), rows
    assert all(r["dtypes"] == ["torch.int64", "torch.int64", "torch.int32"] for r in rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_kernel_matches_the_reference_on_gpu_and_in_a_graph() -> None:
    import appliance.kernels.triton.positions  # noqa: F401
    from appliance.kernels.registry import get

    fast = get("decode_positions", "triton")
    for seed, batch, bs in ((0, 1, 16), (1, 100, 16), (2, 257, 4)):
        rows, table, lens = _random_case(seed, batch, 512, 64, bs, "cuda")
        a, b = lens.clone(), lens.clone()
        got, want = _run(fast, rows, table, a, bs), _run(reference, rows, table, b, bs)
        assert all(torch.equal(x, y) for x, y in zip(got + (a,), want + (b,)))
    # captured: each replay reads the lengths the previous one left
    rows, table, lens = _random_case(3, 16, 64, 8, 16, "cuda")
    lens.clamp_(max=4 * 16)
    start = lens.clone()
    pos = torch.zeros(16, dtype=torch.int64, device="cuda")
    slots, seq = pos.clone(), torch.zeros(16, dtype=torch.int32, device="cuda")
    fast(rows, table, lens, 16, pos, slots, seq)  # compile outside the capture
    lens.copy_(start)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fast(rows, table, lens, 16, pos, slots, seq)
    for k in range(3):
        graph.replay()
        real = rows != 0
        assert torch.equal(pos[real], start[rows[real]] + k)
    assert torch.equal(lens[rows[rows != 0]], start[rows[rows != 0]] + 3)
