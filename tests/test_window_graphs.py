"""Sliding-window KV cache groups under the decode graphs and the piecewise graphs (executor/window_table.py,
executor/cuda_graph.py `bind(table, windows)`, executor/piecewise.py `window_groups`). On the CPU the graph
wrappers run eagerly over the same static buffers and device tables: Gemma 3 and gpt-oss (window 6, shorter than
most prompts, decoding past it) give transformers' greedy tokens with the groups active, through padded decode
graphs and (Gemma 3; gpt-oss declares no pieces) the piecewise path. On a GPU the captured graphs equal eager."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from decode_graphs import use_graphs
from test_models_vs_transformers import PROMPTS
from test_models_windowed import FAMILIES, WINDOW, build_family
from test_moe_models import (
    one_thread,  # noqa: F401  (autouse: one torch thread in this module)
)

from appliance import LLM, SamplingParams
from appliance.engine.sampling_params import SamplingParams as EngineSampling
from appliance.executor.cuda_graph import DecodeGraphs, GraphKey
from appliance.executor.input_batch import Chunk
from appliance.executor.piecewise import PiecewiseGraphs
from appliance.executor.request_table import DeviceBlockTable, LiveRequests, RequestState
from appliance.executor.window_inputs import window_tables
from appliance.executor.window_table import WindowDeviceTables

NEW = 12  # decodes cross three 4-token blocks of every group past the window
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path):
    cache: dict[str, Path] = {}

    def make(family: str) -> Path:
        if family not in cache:
            cache[family] = build_family(family, tmp_path_factory.mktemp(family), tiny_tokenizer_dir)
        return cache[family]

    return make


def _greedy(llm: LLM, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [o.outputs[0].token_ids for o in outs], sum(o.num_cached_tokens for o in outs)


def _matching(llm: LLM, refs: list[tuple[list[int], list[float]]]) -> int:
    """Greedy tokens and their logprobs on PROMPTS equal transformers' (the tiny gpt-oss keeps its argmax through
    a wrong key, not its logprobs); returns the prefix-cache hits."""
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
    for out, (tokens, lps) in zip(outs, refs):
        got = out.outputs[0]
        assert got.token_ids == tokens, out.prompt_token_ids
        assert [got.logprobs[i][t].logprob for i, t in enumerate(tokens)] == pytest.approx(lps, abs=1e-4)
    return sum(o.num_cached_tokens for o in outs)


def _with_decode_graphs(llm: LLM, sizes: list[int]) -> list[GraphKey]:
    """CPU decode graphs of these sizes swapped in; returns the keys they run. After each run the device tables of
    every sliding group must equal the requests' own (what the graph read)."""
    r = llm.executor.runner
    graphs, keys = use_graphs(llm, sizes)
    run = graphs.run

    def checked(decodes: list[Chunk], key: GraphKey, *rest: Any) -> Any:
        out = run(decodes, key, *rest)
        assert graphs.windows is r.window_table is not None
        for c in decodes:
            for g, table in enumerate(c.state.window_tables):
                device = graphs.windows.table[g, c.state.table_row, : len(table)].tolist()
                assert device == table, f"group {g + 1} of {c.state.request_id}"
        return out

    graphs.run = checked  # type: ignore[method-assign]
    return keys


def _groups_active(llm: LLM) -> None:
    runner = llm.executor.runner
    layers = runner.model.attention_layers()
    # the sliding layers in groups as large as the full group's, sharing its pool (executor/window_groups.py)
    groups = sum(a.sliding_window is not None for a in layers) // sum(a.sliding_window is None for a in layers)
    assert runner.kv_layout.window_sizes == llm.engine.config.window_sizes == (WINDOW,) * groups
    assert runner.kv_layout.shared and llm.engine.config.window_shared
    assert {a.kv_group for a in layers if a.sliding_window} == set(range(1, groups + 1))
    assert {a.kv_group for a in layers if a.sliding_window is None} == {0}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_padded_decode_graphs_match_transformers(family: str, family_dir, hf_greedy) -> None:
    path = family_dir(family)
    refs = hf_greedy(path, PROMPTS, NEW)
    assert max(len(p) for p in PROMPTS) > 4 * WINDOW
    llm = LLM(model=str(path), dtype="float32", block_size=4, chunked_prefill_size=16, max_num_seqs=8)
    _groups_active(llm)
    keys = _with_decode_graphs(llm, [1, 2, 4, 8])
    _matching(llm, refs)
    assert GraphKey(8, 16) in keys  # every request decoding, padded to 8 rows
    keys.clear()
    assert _matching(llm, refs) > 0  # prefix-cache hits: new rows whose group tables start with nulls
    assert GraphKey(8, 16) in keys
    assert llm.engine.check_accounting().ok


def test_one_graph_serves_other_requests(family_dir, hf_greedy) -> None:
    """A graph replayed for one set of requests, then another (reused rows, other group tables): each row reads
    its own group tables, uploaded as deltas, not anything fixed at capture."""
    path = family_dir("gemma3")
    llm = LLM(model=str(path), dtype="float32", block_size=4, max_num_seqs=4, enable_prefix_caching=False)
    alone = [_greedy(llm, [p])[0][0] for p in PROMPTS[:3]]
    keys = _with_decode_graphs(llm, [4])
    assert _greedy(llm, PROMPTS[:3])[0] == alone
    assert _greedy(llm, PROMPTS[2:0:-1])[0] == alone[2:0:-1]
    assert set(keys) == {GraphKey(4, 16)}


def _echo_windows(hidden: int):
    """A stand-in model: each row's hidden state is group 1's gathered table, then its slot and the full slot."""
    def forward(ids: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        w = meta.windows[0]
        out = torch.cat([w.decode_block_tables.float(), w.slot_mapping.float()[:, None],
                         meta.slot_mapping.float()[:, None]], 1)
        return torch.nn.functional.pad(out, (0, hidden - out.shape[1]))
    return forward


@pytest.mark.parametrize("blocks_each", [2, 40])  # 40 x 3 rows overflow the static upload of a 4-row graph
def test_graph_steps_address_the_groups_on_the_device(blocks_each: int) -> None:
    """Rows whose group tables the device lacks entirely (new rows, as after a prefix hit): uploaded inline or,
    past the static room, through the overflow copy; every row reads its own group table and slot, the pad row a
    zero table and slot -1."""
    bs, max_blocks = 4, 64
    full = DeviceBlockTable(8, max_blocks, CPU)
    live = LiveRequests(full)
    graphs = DecodeGraphs(_echo_windows(80), 80, torch.float32, CPU, [1, 2, 4], max_blocks, bs)
    graphs.bind(full, WindowDeviceTables(1, full))
    sent: list[int] = []
    send = graphs._overflow.send
    graphs._overflow.send = lambda flat: sent.append(flat.shape[0]) or send(flat)  # type: ignore[method-assign]
    rng = np.random.default_rng(blocks_each)
    decodes = []
    for i in range(3):
        length = (blocks_each - 1) * bs + 1 + i
        st = _state(f"r{i}", rng.integers(1, 999, blocks_each).tolist(), [rng.integers(0, 99, blocks_each).tolist()])
        st.token_ids, st.num_computed = list(range(length)), length - 1
        live[st.request_id] = st
        decodes.append(Chunk(st, length - 1, 1, True))
    key = graphs.key_for(decodes)
    assert key is not None and key.batch == 4
    out = graphs.run(decodes, key)
    assert bool(sent) == (blocks_each == 40)
    for c, row in zip(decodes, out.tolist()):
        t, p = c.state.window_tables[0], c.start
        assert row[: key.width] == [float(x) for x in t + [0] * (key.width - len(t))]
        assert row[key.width] == t[p // bs] * bs + p % bs != row[key.width + 1]
    assert graphs.hidden[3, : key.width + 2].tolist() == [0.0] * key.width + [-1.0, -1.0]


def test_piecewise_and_decode_graphs_match_transformers(family_dir, hf_greedy) -> None:
    """The default GPU run's shape on the CPU: mixed and prefill steps in (emulated) pieces, whose captured KV
    stores write each sliding group through its own static slots, and decode-only steps in decode graphs."""
    path = family_dir("gemma3")
    refs = hf_greedy(path, PROMPTS, NEW)
    llm = LLM(model=str(path), dtype="float32", block_size=4, chunked_prefill_size=16, max_num_seqs=8)
    _groups_active(llm)
    runner = llm.executor.runner
    keys = _with_decode_graphs(llm, [1, 2, 4, 8])
    runner.pieces = PiecewiseGraphs(runner.model, runner.device, runner.dtype, 32, len(runner.kv_layout.groups))
    staged: list[int] = []
    stage = runner.pieces._stage

    def counting(input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, b: int) -> int:
        assert len(meta.windows) == len(runner.kv_layout.groups) == 2  # two sliding groups of one layer
        t = stage(input_ids, positions, meta, b)
        for g, window in enumerate(meta.windows):
            assert torch.equal(runner.pieces.window_slots[g][:t], window.slot_mapping)
            assert bool((runner.pieces.window_slots[g][t:b] == -1).all())  # pad rows store nothing
        staged.append(b)
        return t

    runner.pieces._stage = counting  # type: ignore[method-assign]
    _matching(llm, refs)
    assert staged and keys  # both paths ran
    assert llm.engine.check_accounting().ok


def test_warmup_with_groups_leaves_results_unchanged(family_dir, hf_greedy) -> None:
    """The warm-up's requests (prefills, a graph-replayed decode, a mixed step) carry a table in every
    sliding group, block 0 throughout (the null block, which no query reads), and leave the results unchanged."""
    path = family_dir("gemma3")
    refs = hf_greedy(path, PROMPTS, NEW)
    llm = LLM(model=str(path), dtype="float32", block_size=4, chunked_prefill_size=16, max_num_seqs=8)
    runner = llm.executor.runner
    graphs_run = _with_decode_graphs(llm, [1, 2, 4, 8])  # (capturing pieces needs a GPU: the GPU test's)
    _matching(llm, refs)
    llm.engine.reset_prefix_cache()  # warm-up writes block 0: only before serving, or with nothing cached
    graphs_run.clear()
    live, free_rows = set(runner.requests), runner.block_table.num_free
    assert runner.warmup(graph_context=64) >= 0.0
    assert graphs_run and set(runner.requests) == live and runner.block_table.num_free == free_rows
    _matching(llm, refs)


def test_pieces_refuse_a_step_of_other_groups() -> None:
    pieces = PiecewiseGraphs(torch.nn.Identity(), CPU, torch.float32, 16, window_groups=1)
    meta = pieces._meta(4)
    assert len(meta.windows) == 1 and meta.windows[0].slot_mapping.shape == (4,)
    with pytest.raises(ValueError, match="1 sliding-window groups"):
        PiecewiseGraphs(torch.nn.Identity(), CPU, torch.float32, 16)._stage(
            torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), meta, 16)


def _state(rid: str, blocks: list[int], windows: list[list[int]]) -> RequestState:
    return RequestState(rid, [1] * (4 * len(blocks)), 1, 0, list(blocks), EngineSampling(), window_tables=windows)


def test_device_window_slots_equal_the_host_built_ones() -> None:
    """decode_windows (the graphs' on-device addresses) against window_inputs.window_tables (the eager steps'
    host-built ones) on random tables and positions, pad rows included; a reused row's stale entries are cleared."""
    rng = np.random.default_rng(0)
    bs, groups = 4, 2
    full = DeviceBlockTable(6, 20, CPU)
    windows = WindowDeviceTables(groups, full)
    live = LiveRequests(full)
    old = _state("old", [9] * 20, [[7] * 20, [8] * 20])
    live["old"] = old
    windows.apply(*map(torch.from_numpy, windows.delta([old])))
    del live["old"]
    chunks = []
    for i in range(5):
        n = int(rng.integers(1, 12))
        s = _state(f"r{i}", rng.integers(1, 50, n).tolist(), [rng.integers(0, 50, n).tolist() for _ in range(groups)])
        live[s.request_id] = s
        chunks.append(Chunk(s, int(rng.integers(0, n * bs)), 1, True))
    index, values = windows.delta(c.state for c in chunks)
    windows.apply(torch.from_numpy(index), torch.from_numpy(values))
    assert windows.delta(c.state for c in chunks)[0].size == 0  # everything written once
    reused = next(c.state for c in chunks if c.state.table_row == 1)  # old's row: its tail is zeroed
    assert windows.table[:, 1, len(reused.block_ids):].abs().sum() == 0
    width = 16
    rows = torch.tensor([c.state.table_row for c in chunks] + [0, 0])  # two pad rows
    positions = torch.tensor([c.start for c in chunks] + [0, 0])
    slots = torch.tensor([0] * len(chunks) + [-1, -1])  # the full group's: -1 on pad rows
    got = windows.decode_windows(rows, positions, slots, width, bs)
    want = window_tables(chunks, [], 0, width, 1, bs, CPU)
    for g in range(groups):
        assert torch.equal(got[g].slot_mapping[: len(chunks)], want[g].slot_mapping)
        assert got[g].slot_mapping[len(chunks):].tolist() == [-1, -1]
        assert torch.equal(got[g].decode_block_tables[: len(chunks)], want[g].decode_block_tables)
        assert got[g].decode_block_tables[len(chunks):].abs().sum() == 0


def test_window_delta_checks_its_inputs() -> None:
    full = DeviceBlockTable(2, 8, CPU)
    windows = WindowDeviceTables(1, full)
    with pytest.raises(ValueError, match="at least one"):
        WindowDeviceTables(0, full)
    s = _state("a", [1, 2], [[3, 4], [5, 6]])
    LiveRequests(full)["a"] = s
    with pytest.raises(RuntimeError, match="2 sliding-window tables"):
        windows.delta([s])
    t = _state("b", [1, 2], [[3, 4]])
    with pytest.raises(RuntimeError, match="no block-table row"):
        windows.delta([t])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_window_graphs_match_eager_on_gpu(family: str, tmp_path: Path, tiny_tokenizer_dir: Path) -> None:
    """Captured decode graphs and pieces with the groups active give the eager run's tokens (bf16, Triton)."""
    path = build_family(family, tmp_path / family, tiny_tokenizer_dir)
    llm = LLM(model=str(path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, block_size=16,
              attention_backend="triton", chunked_prefill_size=64, cuda_graph_max_bs=8, enable_prefix_caching=False,
              skip_tokenizer_init=True)
    runner = llm.executor.runner
    assert runner.graphs is not None and runner.graphs.windows is runner.window_table is not None
    groups = {"gemma3": 2, "gpt_oss": 1}[family]  # sliding groups of the full group's size, sharing its pool
    assert runner.kv_layout.window_sizes == (WINDOW,) * groups and runner.kv_layout.shared
    if family == "gemma3":  # gpt-oss declares no pieces
        assert runner.pieces is not None and len(runner.pieces.window_slots) == groups and runner.pieces.pieces
    prompts = [[5, 6, 7], list(range(10, 80)), [9] * 21, [3] * 300]  # four rows: a capture size
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    with_graphs = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    runner.use_graphs = False
    eager = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]
    assert with_graphs == eager
    assert llm.engine.check_accounting().ok
