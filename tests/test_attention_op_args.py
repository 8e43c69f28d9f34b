"""The attention ops' optional arguments. `order`: large decode batches carry the rows' order, longest context
first, in their attention metadata; the Triton decode kernel takes its rows in that order and gives the same bits
as in row order. `out`: the decode and prefill ops of every backend write into rows of a caller's tensor (a mixed
step's output), giving the bits they return otherwise."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.executor.input_batch import Chunk, build_inputs
from appliance.executor.request_table import RequestState
from appliance.layers import attention

BS = 4
ROOT = Path(__file__).resolve().parents[1]


def test_longest_first_orders_large_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    lens = torch.tensor([5, 90, 17, 90, 0, 33], dtype=torch.int32)
    monkeypatch.setattr(attention, "LONGEST_FIRST_MIN_ROWS", 7)
    assert attention.longest_first(lens) is None
    monkeypatch.setattr(attention, "LONGEST_FIRST_MIN_ROWS", 6)
    order = attention.longest_first(lens)
    assert order is not None and sorted(order.tolist()) == list(range(6))
    assert lens[order].tolist() == [90, 90, 33, 17, 5, 0]


def _decode(rng: random.Random, rid: str, length: int) -> Chunk:
    blocks = rng.sample(range(1000), (length + BS - 1) // BS)
    st = RequestState(rid, [rng.randrange(5000) for _ in range(length)], 1, length - 1, blocks, SamplingParams())
    return Chunk(st, length - 1, 1, True)


def test_step_inputs_carry_the_order_of_their_decode_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)
    decodes = [_decode(rng, f"d{i}", rng.randint(1, 60)) for i in range(5)]
    monkeypatch.setattr(attention, "LONGEST_FIRST_MIN_ROWS", 5)
    meta = build_inputs(decodes, BS, torch.device("cpu")).meta
    assert meta.decode_order is not None
    assert meta.decode_seq_lens[meta.decode_order].tolist() == sorted((c.start + 1 for c in decodes), reverse=True)
    monkeypatch.setattr(attention, "LONGEST_FIRST_MIN_ROWS", 6)
    assert build_inputs(decodes, BS, torch.device("cpu")).meta.decode_order is None


KERNEL_CHECK = """
import torch
from appliance.kernels.registry import get
from appliance.kernels.triton.selfcheck_attention import decode_inputs, prefill_inputs
import appliance.kernels.triton  # registers the ops

q, k, v, table, seq, scale = decode_inputs(5, 8, 2, 64, 16, [37, 1, 100, 0, 64], torch.float32, "cpu").args
op = get("decode_attention", "triton")
for backend in ("triton", "torch"):  # out= : rows 2..6 of a larger tensor, the rest untouched
    dec = get("decode_attention", backend)
    big = torch.full((9, 8, 64), 7.0)
    got = dec(q, k, v, table, seq, scale, out=big[2:7])
    assert got.data_ptr() == big[2:7].data_ptr() and torch.equal(got, dec(q, k, v, table, seq, scale)), backend
    assert (big[:2] == 7).all() and (big[7:] == 7).all(), backend
    pq, pk, pv, cu, plens, ptable, pscale = prefill_inputs([5, 1, 70], [0, 20, 33], 4, 2, 64, 16, torch.float32,
                                                           "cpu").args
    pre = get("prefill_attention", backend)
    big = torch.full((pq.shape[0] + 3, 4, 64), 7.0)
    got = pre(pq, pk, pv, cu, plens, ptable, pscale, out=big[3:])
    assert torch.equal(got, pre(pq, pk, pv, cu, plens, ptable, pscale)) and (big[:3] == 7).all(), backend
    try:
        dec(q, k, v, table, seq, scale, out=big[:5, :2])
    except ValueError as exc:
        assert "does not fit q" in str(exc), exc
    else:
        raise AssertionError(f"{backend}: a misshapen out was accepted")
for splits in (None, 3):
    plain = op(q, k, v, table, seq, scale, num_splits=splits)
    for order in (torch.argsort(seq, descending=True), torch.tensor([4, 3, 2, 1, 0])):
        assert torch.equal(op(q, k, v, table, seq, scale, num_splits=splits, order=order), plain), (splits, order)
for splits in (None, 3):  # fresh_rows only moves cache reads past the launch's wait: results are the same
    plain = op(q, k, v, table, seq, scale, num_splits=splits)
    for fresh in (2, 4):
        assert torch.equal(op(q, k, v, table, seq, scale, num_splits=splits, fresh_rows=fresh), plain), fresh
        ref = get("decode_attention", "torch")
        assert torch.equal(ref(q, k, v, table, seq, scale, fresh_rows=fresh), ref(q, k, v, table, seq, scale))
try:
    op(q, k, v, table, seq, scale, fresh_rows=0)
except ValueError as exc:
    assert "fresh_rows" in str(exc)
else:
    raise AssertionError("fresh_rows 0 was accepted")
try:
    op(q, k, v, table, seq, scale, order=torch.zeros(4, dtype=torch.int64))
except ValueError as exc:
    assert "order must be" in str(exc)
else:
    raise AssertionError("a short order was accepted")
print("ok")
"""


def test_the_kernel_gives_the_same_bits_in_any_order() -> None:
    """Under Triton's interpreter (set before triton is imported, hence a subprocess), split and unsplit."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", KERNEL_CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
