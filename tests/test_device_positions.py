"""Positions, slots and seq_lens of decode rows computed on the device (request_table.py `lens`, the
`decode_positions` kernel, itself tested in tests/test_decode_positions_kernel.py): the host mirror and its
corrections, and end to end: every forward reads exactly the positions the host used to build (overlap on and
off, CPU graphs and eager, preemption, prefix caching, aborts, speculative rollbacks), with greedy tokens equal
to transformers'."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from decode_graphs import use_graphs
from decode_layout import build_decode_arrays

from appliance import LLM, SamplingParams
from appliance.executor.cuda_graph import DecodeGraphs
from appliance.executor.input_batch import Chunk, graph_stride
from appliance.executor.request_table import (
    UNKNOWN_POSITION,
    ZERO_ROW,
    DeviceBlockTable,
    LiveRequests,
    RequestState,
)

CPU = torch.device("cpu")


# ---- the host mirror and its corrections -----------------------------------------------------------------------
BS = 4


def _state(rid: str, tokens: int, computed: int) -> RequestState:
    return RequestState(rid, list(range(100, 100 + tokens)), tokens, computed,
                        [10 * (ord(rid[0]) % 50) + i + 1 for i in range(tokens // BS + 2)], SamplingParams())


def _step(table: DeviceBlockTable, chunks: list[Chunk]) -> tuple[list[list[int]], list[int]]:
    """One step's table work as build_inputs does it: block delta, corrections, then advance of the one-token
    rows. Returns the corrections sent and the positions the decode rows got."""
    table.apply(*(torch.from_numpy(x) for x in table.delta(c.state for c in chunks)))
    corrections = table.lens_delta(chunks)
    table.set_lens(torch.from_numpy(corrections[0].copy()), torch.from_numpy(corrections[1].copy()))
    rows = torch.tensor([c.state.table_row for c in chunks if c.num_tokens == 1], dtype=torch.int64)
    pos, slots = torch.zeros(rows.shape[0], dtype=torch.int64), torch.zeros(rows.shape[0], dtype=torch.int64)
    table.advance(rows, BS, pos, slots, torch.zeros(rows.shape[0], dtype=torch.int32))
    for c in chunks:  # the device and the mirror agree after every step
        assert table.lens[c.state.table_row] == c.state.pos_on_device == c.start + c.num_tokens
    return corrections.T.tolist(), pos.tolist()


def test_corrections_only_where_the_start_differs_from_the_mirror() -> None:
    table = DeviceBlockTable(4, 16, CPU)
    live = LiveRequests(table)
    a, b = _state("a", 9, 0), _state("b", 13, 8)  # b: 8 tokens hit the prefix cache
    live["a"], live["b"] = a, b
    assert a.pos_on_device == b.pos_on_device == UNKNOWN_POSITION
    # prefill chunks: lens is set to their end at once (their positions are host-built)
    sent, _ = _step(table, [Chunk(a, 0, 9, True), Chunk(b, 8, 5, True)])
    assert sent == [[a.table_row, 9], [b.table_row, 13]]
    for n in range(3):  # steady decodes: nothing travels, the device advances
        for s in (a, b):
            s.token_ids.append(7)
        sent, pos = _step(table, [Chunk(a, 9 + n, 1, True), Chunk(b, 13 + n, 1, True)])
        assert sent == [] and pos == [9 + n, 13 + n]
    # a speculative verification of 1 + 3 tokens, then 2 drafts rejected: num_computed rolls back
    a.token_ids += [7, 7, 7]
    sent, _ = _step(table, [Chunk(a, 12, 4, True)])
    assert sent == [[a.table_row, 16]]
    sent, pos = _step(table, [Chunk(a, 14, 1, True), Chunk(b, 16, 1, True)])
    assert sent == [[a.table_row, 14]] and pos == [14, 16]
    assert table.lens[ZERO_ROW] == 0


def test_a_reused_row_is_always_corrected() -> None:
    table = DeviceBlockTable(1, 16, CPU)
    live = LiveRequests(table)
    old = _state("old", 20, 0)
    live["old"] = old
    _step(table, [Chunk(old, 0, 20, True)])
    row = old.table_row
    live.pop("old")  # finished, aborted or preempted
    assert old.pos_on_device == UNKNOWN_POSITION
    new = _state("new", 21, 20)  # same row; its start equals what the row holds: corrected all the same
    live["new"] = new
    assert new.table_row == row and table.lens[row] == 20
    sent, pos = _step(table, [Chunk(new, 20, 1, True)])
    assert sent == [[row, 20]] and pos == [20]
    stray = _state("stray", 5, 4)
    with pytest.raises(RuntimeError, match="no block-table row"):
        table.lens_delta([Chunk(stray, 4, 1, True)])


def test_graph_inputs_equal_the_host_built_layout() -> None:
    """A graph's padded inputs after the device computed them equal build_decode_arrays' host layout (what a
    graph step uploaded before), over steps that cross block boundaries, with a correction midway."""
    table = DeviceBlockTable(8, 16, CPU)
    live = LiveRequests(table)
    seen: list[tuple[list[int], ...]] = []

    def forward(ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        seen.append((ids.tolist(), positions.tolist(), meta.slot_mapping.tolist(), meta.decode_seq_lens.tolist()))
        return torch.zeros(ids.shape[0], 4)

    graphs = DecodeGraphs(forward, 4, torch.float32, CPU, [1, 4], 16, BS, table)
    states = [_state(rid, n, n - 1) for rid, n in (("a", 7), ("b", 12), ("c", 1))]
    for s in states:
        live[s.request_id] = s
    for step in range(6):
        if step == 3:
            states[0].num_computed -= 2  # as a rollback would (its tokens are still there)
        decodes = [Chunk(s, s.num_computed, 1, True) for s in states]
        key = graphs.key_for(decodes)
        graphs.run(decodes, key)
        host = np.full(5 * graph_stride(key.batch), 99, np.int64)
        build_decode_arrays(decodes, BS, key.batch, key.width, host)
        ids, pos, slots, lens, _ = host.reshape(5, -1)[:, : key.batch].tolist()
        assert seen[-1] == (ids, pos, slots, lens), step
        for s in states:
            s.num_computed += 1
            s.token_ids.append(step)


# ---- end to end: what the model reads ------------------------------------------------------------------------
class PositionSpy:
    """Wraps a runner: every forward of a step must read the positions, slots and seq_lens the host used to
    build (arange per chunk; slot from block_ids; pad rows 0 / -1 / 0), and after every step the device
    lengths must equal the mirrors. Counts forwards, graph-padded forwards, decode rows, the corrections sent
    and the rollbacks among them (a chunk starting before what the device holds)."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.chunks = runner, None
        self.forwards = self.padded = self.decode_rows = self.corrections = self.rollbacks = 0
        step, model_forward, lens_delta = runner._forward, runner.model.forward, runner.block_table.lens_delta

        def forward_step(chunks: list[Chunk]) -> Any:
            self.chunks = list(chunks)
            try:
                out = step(chunks)
            finally:
                self.chunks = None
            lens = runner.block_table.lens.tolist()
            for c in chunks:
                assert lens[c.state.table_row] == c.state.pos_on_device == c.start + c.num_tokens
            assert lens[ZERO_ROW] == 0
            return out

        def forward(ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
            if self.chunks is not None:
                self._check(positions, meta)
            return model_forward(ids, positions, meta)

        def counted(chunks: Any) -> Any:
            chunks = list(chunks)
            self.rollbacks += sum(c.start < c.state.pos_on_device for c in chunks)
            self.decode_rows += sum(c.num_tokens == 1 for c in chunks)
            out = lens_delta(chunks)
            self.corrections += out.shape[1]
            return out

        runner._forward, runner.model.forward, runner.block_table.lens_delta = forward_step, forward, counted

    def _check(self, positions: torch.Tensor, meta: Any) -> None:
        bs = self.runner.block_size
        decodes = [c for c in self.chunks if c.num_tokens == 1]
        order = decodes + [c for c in self.chunks if c.num_tokens > 1]
        pos = [p for c in order for p in range(c.start, c.start + c.num_tokens)]
        slots = [c.state.block_ids[p // bs] * bs + p % bs
                 for c in order for p in range(c.start, c.start + c.num_tokens)]
        t, nd = len(pos), len(decodes)
        assert positions[:t].tolist() == pos
        assert meta.slot_mapping[:t].tolist() == slots
        assert meta.decode_seq_lens[:nd].tolist() == [c.start + 1 for c in decodes]
        pad = positions.shape[0] - t  # a graph's padding rows
        assert positions[t:].tolist() == [0] * pad and meta.slot_mapping[t:].tolist() == [-1] * pad
        assert meta.decode_seq_lens[nd:].tolist() == [0] * pad
        self.forwards += 1
        self.padded += pad > 0


PROMPTS = [[5, 6, 7, 8, 9], [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 50, 51], [77], list(range(200, 217)),
           [7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 60], [90] * 3 + list(range(100, 110))]
NEW = 8


@pytest.fixture(scope="module")
def references(tiny_model: Path, hf_greedy: Any) -> list[list[int]]:
    return [tokens for tokens, _ in hf_greedy(tiny_model, PROMPTS, NEW)]


def _drive(llm: LLM, abort: str | None) -> dict[str, list[int]]:
    """Every prompt through the engine (request i = "r{i}"); `abort` is aborted after its 3rd token."""
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while eng.has_work():
        for d in eng.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
        if abort is not None and len(out.get(abort, [])) >= 3 and eng.get_request(abort) is not None:
            eng.abort(abort)
    return out


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("graphs", [False, True])
def test_every_forward_reads_the_host_positions(tiny_model: Path, references: list[list[int]], overlap: bool,
                                                graphs: bool) -> None:
    """A 64-token cache (preemption and recompute), prefix caching with shared prefixes, 16-token chunks,
    one-token prompts and an abort; then a second pass on the reused rows, whose prefixes are cached."""
    llm = LLM(model=str(tiny_model), dtype="float32", block_size=4, skip_tokenizer_init=True,
              enable_prefix_caching=True, chunked_prefill_size=16, max_total_tokens=64, max_model_len=64,
              enable_overlap_schedule=overlap, schedule_conservativeness=0.0)  # admit greedily: preemption
    assert llm.engine.overlap == overlap
    if graphs:
        use_graphs(llm, [1, 2, 4, 8])
    spy = PositionSpy(llm.executor.runner)
    got = _drive(llm, abort="r3")
    assert len(got["r3"]) < NEW
    for i, ref in enumerate(references):
        if i != 3:
            assert got[f"r{i}"] == ref, i
    again = _drive(llm, abort=None)
    assert [again[f"r{i}"] for i in range(len(PROMPTS))] == references
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and llm.engine.check_accounting().ok
    assert spy.forwards > 0 and (spy.padded > 0) == graphs
    # corrections: new and preempted requests and every prefill chunk; decode rows mostly send none
    assert 0 < spy.corrections < spy.decode_rows and spy.rollbacks == 0


@pytest.mark.parametrize("on_device", [True, False])
def test_speculative_rollbacks_are_corrected(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             on_device: bool) -> None:
    """MTP on a dummy-weight DeepSeek-V3 (its own drafts, mostly rejected): verification chunks set lens to
    their end; a verification decided on the device (device_verification.py) sets it back to the accepted
    length there, so the next step sends no correction, while one the host verifier decides is corrected by
    the next step; tokens equal the run without drafts either way."""
    import transformers
    from spec_fixtures import MTP_TINY

    from appliance.executor.speculative import Speculator

    if not on_device:
        monkeypatch.setattr(Speculator, "_decided_on_device", lambda self, state, d: False)
    cfg = transformers.DeepseekV3Config(**MTP_TINY)
    cfg.architectures = ["DeepseekV3ForCausalLM"]
    cfg.save_pretrained(str(tmp_path))
    prompts = [{"prompt_token_ids": p} for p in PROMPTS[:4]]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)

    def run(**spec: Any) -> tuple[list[list[int]], LLM, PositionSpy]:
        llm = LLM(model=str(tmp_path), dtype="float32", block_size=4, skip_tokenizer_init=True, load_format="dummy",
                  chunked_prefill_size=8, **spec)
        spy = PositionSpy(llm.executor.runner)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, sp)], llm, spy

    plain, _, _ = run()
    tokens, llm, spy = run(speculative_algorithm="MTP", speculative_num_steps=2)
    assert tokens == plain
    stats = llm.engine.stats()
    assert stats.spec_num_draft_tokens > stats.spec_num_accepted_tokens  # some drafts were rejected
    assert spy.forwards > 0 and (spy.rollbacks == 0) == on_device
    runner = llm.executor.runner
    assert runner.block_table.lens.tolist()[0] == 0


GPU_PROMPTS = [[3 + i] * n for i, n in enumerate((1, 14, 15, 16, 31, 33, 47, 200, 1, 14, 15))]
GPU_MAX_TOKENS = (60, 60, 60, 9, 60, 33, 60, 40, 5, 60, 60)
GPU_POOL: dict[str, Any] = {"block_size": 16, "max_total_tokens": 320, "max_model_len": 256, "max_num_seqs": 8,
                            "enable_prefix_caching": False, "schedule_conservativeness": 0.0}  # it must preempt


def test_the_gpu_workload_preempts(tiny_model: Path) -> None:
    """The workload of the GPU test below, on the CPU: its pool is small enough to preempt."""
    llm = LLM(model=str(tiny_model), dtype="float32", skip_tokenizer_init=True, **GPU_POOL)
    sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in GPU_MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in GPU_PROMPTS], sp)
    assert [len(o.outputs[0].token_ids) for o in outs] == list(GPU_MAX_TOKENS)
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphs_give_the_eager_tokens_on_gpu(tiny_model: Path) -> None:
    """A small random Llama on CUDA (Triton kernels, captured decode graphs computing the positions): greedy
    tokens equal eager decoding, overlap on and off, with a pool small enough to preempt (prefix caching off:
    every run prefills alike, only the decode path differs); the device lengths equal the mirrors afterwards."""
    prompts = [{"prompt_token_ids": p} for p in GPU_PROMPTS]
    sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in GPU_MAX_TOKENS]
    for overlap in (True, False):
        llm = LLM(model=str(tiny_model), dtype="bfloat16", skip_tokenizer_init=True, cuda_graph_max_bs=8,
                  enable_overlap_schedule=overlap, **GPU_POOL)
        runner = llm.executor.runner
        assert runner.graphs is not None and runner.block_table.lens.is_cuda and llm.engine.overlap == overlap
        runs = []
        for use in (True, False, True):  # the third on rows the earlier runs left behind
            runner.use_graphs = use
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, sp)])
            for st in runner.requests.values():
                assert int(runner.block_table.lens[st.table_row]) == st.pos_on_device
        assert runner.graphs.graphs and runner.graphs.last_key is not None
        assert llm.engine.stats().num_preemptions > 0
        assert runs[0] == runs[1] == runs[2], overlap
