"""Persistent device block tables (executor/request_table.py): rows per live request, deltas, row reuse, and
the runner's and the graphs' use of them (greedy tokens unchanged)."""
from __future__ import annotations

import random

import pytest
import torch

from appliance.config import build_config
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.step import NewRequestData, ScheduledRequest, StepPlan
from appliance.executor.cuda_graph import DELTA_ROOM, DecodeGraphs, GraphKey
from appliance.executor.input_batch import Chunk, graph_stride
from appliance.executor.request_table import (
    ZERO_ROW,
    DeviceBlockTable,
    LiveRequests,
    RequestState,
)

CPU = torch.device("cpu")


def _state(rid: str, blocks: list[int]) -> RequestState:
    return RequestState(rid, [1, 2, 3], 3, 0, list(blocks), SamplingParams())


def _sync(table: DeviceBlockTable, states: list[RequestState]) -> int:
    index, blocks = table.delta(states)
    table.apply(torch.from_numpy(index), torch.from_numpy(blocks))
    return index.shape[0]


def _row(table: DeviceBlockTable, state: RequestState) -> list[int]:
    return table.table[state.table_row].tolist()


def test_rows_are_given_and_taken_back() -> None:
    table = DeviceBlockTable(3, 5, CPU)
    assert table.width == 16 and table.table.shape == (4, 16)  # + the zero row; columns rounded to 16
    live = LiveRequests(table)
    a, b, c = _state("a", [1]), _state("b", [2]), _state("c", [3])
    live["a"], live["b"], live["c"] = a, b, c
    assert [a.table_row, b.table_row, c.table_row] == [1, 2, 3] and table.num_free == 0
    assert live.pop("b") is b and b.table_row == ZERO_ROW and table.num_free == 1
    d = _state("d", [4])
    live["d"] = d
    assert d.table_row == 2  # b's row, reused
    del live["a"]
    live.clear()
    assert table.num_free == 3 and len(live) == 0 and a.table_row == c.table_row == d.table_row == ZERO_ROW
    with pytest.raises(ValueError, match="added under id"):
        live["x"] = _state("y", [1])


def test_a_full_table_says_why() -> None:
    live = LiveRequests(DeviceBlockTable(2, 4, CPU))
    live["a"], live["b"] = _state("a", [1]), _state("b", [2])
    with pytest.raises(RuntimeError, match=r"all 2 rows .*max_num_seqs"):
        live["c"] = _state("c", [3])
    assert "c" not in live and len(live) == 2
    with pytest.raises(ValueError, match="capacity >= 1"):
        DeviceBlockTable(0, 4, CPU)


def test_only_new_block_ids_travel() -> None:
    table = DeviceBlockTable(4, 20, CPU)
    live = LiveRequests(table)
    a, b = _state("a", [5, 6, 7]), _state("b", [9])
    live["a"], live["b"] = a, b
    assert _sync(table, [a, b]) == 4
    assert _row(table, a)[:4] == [5, 6, 7, 0] and _row(table, b)[:2] == [9, 0]
    assert _sync(table, [a, b]) == 0  # nothing new: nothing sent
    a.block_ids.append(8)
    index, blocks = table.delta([a, b])
    assert index.tolist() == [a.table_row * table.width + 3] and blocks.tolist() == [8]
    table.apply(torch.from_numpy(index), torch.from_numpy(blocks))
    assert _row(table, a)[:5] == [5, 6, 7, 8, 0] and a.blocks_on_device == 4
    assert table.table[ZERO_ROW].tolist() == [0] * table.width  # never written
    rows = torch.tensor([b.table_row, ZERO_ROW, a.table_row], dtype=torch.int32)
    assert table.gather(rows, 4).tolist() == [[9, 0, 0, 0], [0, 0, 0, 0], [5, 6, 7, 8]]


def test_row_reuse_never_leaks_the_previous_owners_blocks() -> None:
    table = DeviceBlockTable(1, 40, CPU)
    live = LiveRequests(table)
    old = _state("old", list(range(100, 130)))
    live["old"] = old
    _sync(table, [old])
    live.pop("old")  # aborted
    new = _state("new", [7, 8])
    live["new"] = new
    assert new.table_row == 1  # the same row
    assert _sync(table, [new]) == 30  # its 2 blocks and zeros over the 28 the old owner left
    assert _row(table, new) == [7, 8] + [0] * (table.width - 2)
    new.block_ids += [9]
    assert _sync(table, [new]) == 1 and _row(table, new)[:4] == [7, 8, 9, 0]


def test_a_preempted_request_comes_back_with_a_new_row_and_its_whole_table() -> None:
    table = DeviceBlockTable(2, 8, CPU)
    live = LiveRequests(table)
    first = _state("a", [1, 2, 3])
    live["a"] = first
    _sync(table, [first])
    live.pop("a")  # finished_ids: preempted
    back = _state("a", [4, 5])  # recomputed on other blocks
    live["a"] = back
    assert back.blocks_on_device == 0 and _sync(table, [back]) == 3  # two blocks and one stale column cleared
    assert _row(table, back)[:4] == [4, 5, 0, 0]
    replaced = _state("a", [6])  # re-added under the same id without a drop: the old row is freed
    live["a"] = replaced
    assert table.num_free == 1 and back.table_row == ZERO_ROW


def test_bad_tables_are_refused() -> None:
    table = DeviceBlockTable(2, 4, CPU)
    with pytest.raises(RuntimeError, match="no block-table row"):
        table.delta([_state("stray", [1])])
    live = LiveRequests(table)
    s = _state("a", [1, 2])
    live["a"] = s
    _sync(table, [s])
    s.block_ids.pop()
    with pytest.raises(RuntimeError, match="shrank"):
        table.delta([s])
    big = _state("b", list(range(17)))
    live["b"] = big
    with pytest.raises(ValueError, match="17 blocks exceed"):
        table.delta([big])
    with pytest.raises(ValueError, match="exceeds"):
        table.gather(torch.zeros(1, dtype=torch.int32), 17)


def _echo_tables(hidden: int):
    """A stand-in model: each row's hidden state is its gathered block table (then seq_len, slot, id)."""
    def forward(ids: torch.Tensor, pos: torch.Tensor, meta) -> torch.Tensor:
        t = meta.decode_block_tables.float()
        extra = torch.stack([meta.decode_seq_lens.float(), meta.slot_mapping.float(), ids.float()], 1)
        return torch.nn.functional.pad(torch.cat([t, extra], 1), (0, hidden - t.shape[1] - 3))
    return forward


@pytest.mark.parametrize("blocks_each", [2, 40])  # 40 x 4 rows overflow the static delta room of batch 4
def test_graph_inputs_gather_the_device_table(blocks_each: int) -> None:
    bs, max_blocks = 4, 64
    table = DeviceBlockTable(8, max_blocks, CPU)
    live = LiveRequests(table)
    graphs = DecodeGraphs(_echo_tables(80), 80, torch.float32, CPU, [1, 2, 4], max_blocks, bs, table)
    rng = random.Random(blocks_each)
    decodes = []
    for i in range(3):
        blocks = rng.sample(range(1, 1000), blocks_each)
        length = (blocks_each - 1) * bs + 1 + i
        st = RequestState(f"r{i}", list(range(length)), 1, length - 1, blocks, SamplingParams())
        live[st.request_id] = st
        decodes.append(Chunk(st, length - 1, 1, True))
    assert (2 * 3 * blocks_each > DELTA_ROOM * graph_stride(4)) == (blocks_each == 40)
    key = graphs.key_for(decodes)
    assert key == GraphKey(4, 16 if blocks_each == 2 else 64)
    out = graphs.run(decodes, key)
    for c, row in zip(decodes, out.tolist()):
        b = c.state.block_ids
        assert row[: key.width] == [float(x) for x in b + [0] * (key.width - len(b))]
        assert row[key.width : key.width + 3] == [c.start + 1, b[c.start // bs] * bs + c.start % bs, c.start]
    # the padding row: zero table, seq_len 0, slot -1 (read through the full static output)
    assert graphs.hidden[3, : key.width + 2].tolist() == [0.0] * (key.width + 1) + [-1.0]


# ---- the runner: tokens through the device tables ------------------------------------------------------------
BLOCK = 4


def _runner(path, **flat):
    from appliance.executor.model_runner import ModelRunner

    return ModelRunner(build_config(flat=dict(model=str(path), dtype="float32", block_size=BLOCK,
                                              max_total_tokens=512, **flat), env={}))


def _tokens(results) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for res in results:
        for t in res.sampled:
            out.setdefault(t.request_id, []).append(t.token_id)
    return out


def test_preempted_request_resumes_with_identical_tokens(tiny_model) -> None:
    """b is dropped after 3 decodes and comes back on other blocks with prompt + outputs so far (recompute):
    its tokens equal an uninterrupted run; a, decoding across block boundaries meanwhile, is unaffected."""
    greedy = SamplingParams(temperature=0.0).to_dict()
    pa, pb = [5, 6, 7, 8, 9], [40, 41, 42]

    def run(preempt: bool) -> dict[str, list[int]]:
        runner = _runner(tiny_model, max_num_seqs=2)
        news = [NewRequestData("a", pa, 5, 0, [1, 2], greedy), NewRequestData("b", pb, 3, 0, [3], greedy)]
        results = [runner.execute(StepPlan(0, news, [ScheduledRequest("a", 5, [], True),
                                                     ScheduledRequest("b", 3, [], True)]))]
        a_blocks, b_blocks = 2, 1
        for step in range(1, 12):
            new, finished = [], []
            sched = []
            a_len = 5 + step - 1  # tokens a has computed before this step
            grow = [10 + step] if a_len + 1 > 4 * a_blocks else []
            a_blocks += len(grow)
            sched.append(ScheduledRequest("a", 1, grow, True))
            if preempt and step == 4:
                finished = ["b"]  # b had 3 prompt + 3 generated tokens: back with a new table
                state = runner.requests["b"]
                tokens = list(state.token_ids)
                new = [NewRequestData("b", tokens, 3, 0, [60, 61], greedy)]
                sched.append(ScheduledRequest("b", len(tokens), [], True))
                b_blocks = 2
            else:
                b_len = len(runner.requests["b"].token_ids) - 1
                grow_b = [30 + step] if b_len + 1 > 4 * b_blocks else []
                b_blocks += len(grow_b)
                sched.append(ScheduledRequest("b", 1, grow_b, True))
            results.append(runner.execute(StepPlan(step, new, sched, finished)))
        assert runner.block_table.num_free == 0
        runner.requests.clear()
        assert runner.block_table.num_free == 2
        return _tokens(results)

    assert run(True) == run(False)


def test_rows_follow_requests_through_the_engine(tiny_model) -> None:
    from appliance import LLM

    llm = LLM(model=str(tiny_model), dtype="float32", block_size=4, max_total_tokens=2048, skip_tokenizer_init=True,
              max_num_seqs=4)
    table = llm.executor.runner.block_table
    sp = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 11, 7, 2, 9, 5)]
    prompts = [{"prompt_token_ids": list(range(5 + i, 12 + 3 * i))} for i in range(6)]
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    # finished requests give their rows back when the next plan's finished_ids reach the worker: the ones
    # still held are exactly those the scheduler has yet to send
    live = llm.executor.runner.requests
    assert table.num_free + len(live) == 4 and set(live) == set(llm.engine.scheduler.pending_forget)
    assert [len(t) for t in first] == [3, 11, 7, 2, 9, 5]
    # the rows are reused, in another order, by requests with shorter tables: same tokens
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], sp[::-1])]
    assert again[::-1] == first
    assert table.num_free + len(live) == 4 and set(live) == set(llm.engine.scheduler.pending_forget)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_over_device_tables_match_eager_on_gpu(tiny_model) -> None:
    """Graphs on, a batch whose tables grow across block boundaries (and rows reused between batches): the
    tokens equal eager decoding over the same device tables."""
    from appliance import LLM

    llm = LLM(model=str(tiny_model), dtype="bfloat16", block_size=16, max_total_tokens=16384,
              skip_tokenizer_init=True, cuda_graph_max_bs=8, max_num_seqs=8,
              enable_prefix_caching=False)  # every run prefills alike: only the decode path differs
    runner = llm.executor.runner
    assert runner.graphs is not None and runner.graphs.table is runner.block_table
    prompts = [{"prompt_token_ids": [3 + i] * n} for i, n in enumerate((14, 15, 16, 31, 33, 47, 250))]
    sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 20, 40, 9, 40, 33, 40)]
    with_graphs = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    keys = set(runner.graphs.graphs)
    assert keys and runner.graphs.last_key is not None
    runner.use_graphs = False
    eager = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert with_graphs == eager
    runner.use_graphs = True  # again, on rows the earlier requests used (freed rows are handed out in another order)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == eager
    assert runner.block_table.num_free + len(runner.requests) == 8
