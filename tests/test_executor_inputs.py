"""Step input building: the numpy/pinned path against a plain per-row reference, and the graphs' padded layout."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.executor.input_batch import (
    Chunk,
    build_graph_rows,
    build_inputs,
    graph_stride,
)
from appliance.executor.request_table import (
    DeviceBlockTable,
    LiveRequests,
    RequestState,
)

BS = 4


def _state(rng: random.Random, rid: str, length: int, computed: int) -> RequestState:
    blocks = rng.sample(range(1000), (length + BS - 1) // BS)
    return RequestState(rid, [rng.randrange(5000) for _ in range(length)], max(1, length - 3), computed, blocks,
                        SamplingParams())


def _random_chunks(seed: int) -> list[Chunk]:
    rng = random.Random(seed)
    chunks = []
    for i in range(rng.randint(1, 7)):
        length = rng.randint(1, 40)
        if rng.random() < 0.5:  # a decode: one token at the end
            chunks.append(Chunk(_state(rng, f"d{i}", length, length - 1), length - 1, 1, True))
        else:
            start = rng.randint(0, length - 2) if length > 1 else 0
            n = length - start
            chunks.append(Chunk(_state(rng, f"p{i}", length, start), start, n, True))
    rng.shuffle(chunks)
    return chunks


@pytest.mark.parametrize("seed", range(6))
def test_build_inputs_matches_per_row_reference(seed: int) -> None:
    chunks = _random_chunks(seed)
    inp = build_inputs(chunks, BS, torch.device("cpu"), decode_width=3)
    decodes = [c for c in chunks if c.num_tokens == 1]
    prefills = [c for c in chunks if c.num_tokens > 1]
    assert inp.chunks == decodes + prefills
    ids, pos, slots, starts = [], [], [], []
    for c in decodes + prefills:
        starts.append(len(ids))
        for p in range(c.start, c.start + c.num_tokens):
            ids.append(c.state.token_ids[p])
            pos.append(p)
            slots.append(c.state.block_ids[p // BS] * BS + p % BS)
    assert inp.row_starts == starts
    assert inp.input_ids.tolist() == ids and inp.positions.tolist() == pos
    m = inp.meta
    assert m.slot_mapping.tolist() == slots and m.num_decode_tokens == len(decodes)
    assert m.decode_seq_lens.dtype == torch.int32 and m.decode_seq_lens.tolist() == [c.start + 1 for c in decodes]
    assert m.prefill_seq_lens.tolist() == [c.start + c.num_tokens for c in prefills]
    assert m.prefill_cu_seqlens.tolist() == list(np.cumsum([0] + [c.num_tokens for c in prefills]))
    assert not decodes or m.decode_block_tables.shape[1] >= 3  # padded to the requested width
    # every tensor handed to a kernel starts 16-byte aligned (Triton specialises pointers on it)
    for x in (inp.input_ids, inp.positions, m.slot_mapping, m.decode_seq_lens, m.decode_block_tables,
              m.prefill_cu_seqlens, m.prefill_seq_lens, m.prefill_block_tables):
        assert (x.storage_offset() * x.element_size()) % 16 == 0
    for table, group in ((m.decode_block_tables, decodes), (m.prefill_block_tables, prefills)):
        assert table.dtype == torch.int32 and table.shape[0] == len(group)
        for row, c in zip(table.tolist(), group):
            assert row[: len(c.state.block_ids)] == c.state.block_ids


def test_build_inputs_refuses_a_short_block_table() -> None:
    st = RequestState("r", list(range(9)), 9, 8, [3, 4], SamplingParams())  # 9 tokens need 3 blocks of 4
    with pytest.raises(RuntimeError, match="need 3 blocks"):
        build_inputs([Chunk(st, 8, 1, True)], BS, torch.device("cpu"))


def test_graph_rows_pad_with_the_zero_row() -> None:
    """A graph's upload is [ids | table rows]; pad rows take token 0 and the device table's all-zero row, which
    the device turns into position 0, seq_len 0 and slot -1 (tests/test_device_positions.py)."""
    rng = random.Random(3)
    decodes = [Chunk(s, s.num_computed, 1, True) for s in (_state(rng, "a", 9, 8), _state(rng, "b", 3, 2))]
    decodes[0].state.table_row, decodes[1].state.table_row = 7, 3
    batch, width = 4, 8
    stride = graph_stride(batch)
    out64 = np.full(3 * 8, 77, np.int64)
    build_graph_rows(decodes, BS, batch, width, out64)
    ids, rows = out64[: 2 * stride].reshape(2, stride)[:, :batch]
    assert ids.tolist() == [decodes[0].state.token_ids[8], decodes[1].state.token_ids[2], 0, 0]
    assert rows.tolist() == [7, 3, 0, 0]
    assert (out64[2 * stride :] == 77).all()  # nothing written past the layout
    with pytest.raises(ValueError, match="do not fit"):
        build_graph_rows(decodes * 3, BS, batch, width, out64)
    with pytest.raises(ValueError, match="do not fit"):
        build_graph_rows(decodes, BS, batch, 2, out64)  # "a" has 3 blocks


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pad", [False, True])
def test_device_tables_give_the_host_built_inputs(seed: int, pad: bool) -> None:
    """With the persistent table, the gathered tables (and everything else) equal the host-built ones, over
    steps that add blocks, on a table whose rows were used by other requests before."""
    chunks = _random_chunks(seed)
    table = DeviceBlockTable(16, 32, torch.device("cpu"))
    live = LiveRequests(table)
    rng = random.Random(seed)
    for i in range(5):  # earlier owners leave long tables in the rows the step's requests get
        old = RequestState(f"old{i}", [1], 1, 0, rng.sample(range(1000), 30), SamplingParams())
        live[old.request_id] = old
        table.apply(*(torch.from_numpy(x) for x in table.delta([old])))
    live.clear()
    for c in chunks:
        live[c.state.request_id] = c.state
    for step in range(3):
        want = build_inputs(chunks, BS, torch.device("cpu"), 3, pad_prefills=pad)
        got = build_inputs(chunks, BS, torch.device("cpu"), 3, pad_prefills=pad, table=table)
        for name in ("input_ids", "positions"):
            assert torch.equal(getattr(got, name), getattr(want, name))
        for name in ("slot_mapping", "decode_block_tables", "decode_seq_lens", "prefill_cu_seqlens",
                     "prefill_seq_lens", "prefill_block_tables"):
            x, y = getattr(got.meta, name), getattr(want.meta, name)
            assert x.dtype == y.dtype and torch.equal(x, y), (step, name)
            assert (x.storage_offset() * x.element_size()) % 16 == 0
        assert all(c.state.blocks_on_device == len(c.state.block_ids) for c in chunks)
        for c in chunks:  # the next step: each request grew by a block
            c.state.block_ids.append(1000 + 10 * step + len(c.state.block_ids))


def test_padded_prefills_add_empty_sequences_and_round_the_width() -> None:
    rng = random.Random(5)
    chunks = [Chunk(s, 0, len(s.token_ids), True) for s in (_state(rng, f"p{n}", n, 0) for n in (7, 30, 12))]
    inp = build_inputs(chunks, BS, torch.device("cpu"), pad_prefills=True)
    m = inp.meta
    real = [c.start + c.num_tokens for c in chunks]
    assert m.prefill_seq_lens.tolist() == real + [0]  # 3 -> 4 sequences
    cu = m.prefill_cu_seqlens.tolist()
    assert len(cu) == 5 and cu[-1] == cu[-2] == sum(c.num_tokens for c in chunks)
    assert m.prefill_block_tables.shape == (4, 16) and m.prefill_block_tables[3].tolist() == [0] * 16
    plain = build_inputs(chunks, BS, torch.device("cpu"))
    assert inp.input_ids.tolist() == plain.input_ids.tolist() and inp.row_starts == plain.row_starts


def test_padded_prefills_give_the_same_tokens(tiny_model) -> None:
    from appliance import LLM

    llm = LLM(model=str(tiny_model), dtype="float32", block_size=4, max_total_tokens=2048, skip_tokenizer_init=True,
              enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 9)]
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    llm.executor.runner._pad_prefills = True
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == plain


@pytest.mark.parametrize("pad", [False, True])
def test_window_groups_get_their_own_slots_and_tables(pad: bool) -> None:
    """Requests with sliding-window tables (executor/window_inputs.py): each group's slot of every row and its
    decode / prefill table rows come from that group's table, in build_inputs' row order, beside the full ones."""
    rng = random.Random(3)
    chunks = _random_chunks(3)
    for c in chunks:  # two groups; null entries (0) before the window, as the engine sends them for a hit
        n = len(c.state.block_ids)
        c.state.window_tables = [[0] * min(1, n) + rng.sample(range(1, 100), n - min(1, n)) for _ in range(2)]
    inp = build_inputs(chunks, BS, torch.device("cpu"), decode_width=3, pad_prefills=pad)
    m = inp.meta
    decodes, prefills = [c for c in chunks if c.num_tokens == 1], [c for c in chunks if c.num_tokens > 1]
    assert len(m.windows) == 2
    for g, w in enumerate(m.windows):
        want = [c.state.window_tables[g][p // BS] * BS + p % BS
                for c in decodes + prefills for p in range(c.start, c.start + c.num_tokens)]
        assert w.slot_mapping.dtype == torch.int64 and w.slot_mapping.tolist() == want
        assert w.decode_block_tables.shape == m.decode_block_tables.shape
        assert w.prefill_block_tables.shape == m.prefill_block_tables.shape  # padded sequences included
        for table, group in ((w.decode_block_tables, decodes), (w.prefill_block_tables, prefills)):
            assert table.dtype == torch.int32
            for row, c in zip(table.tolist(), group):
                assert row[: len(c.state.window_tables[g])] == c.state.window_tables[g]
    plain = build_inputs(_random_chunks(3), BS, torch.device("cpu"), decode_width=3)
    assert plain.meta.windows == ()  # a model of one group: no window addresses at all
