"""CUDA graphs for decode-only steps: capture sizes, padding, and the captured forwards.

A step whose rows are all one-token decodes (no prompt logprobs) replays a graph captured for the smallest
capture size >= its batch; the extra rows are padding (token 0, slot -1 so nothing is stored, seq_len 0 so
decode attention reads nothing and writes zeros). Graphs are keyed by (batch size, block-table width): the
Triton decode kernel picks its split-K factor from the table's width, never from seq_lens (no host sync), so
the width is bucketed to a power of two of blocks, which keeps the split factor near what the real context
needs instead of what max_model_len allows. A batch from `unsplit_from` on launches no split-K at any width
(the GPU is full without it), so its graphs differ only in the gathered table's width: those batches share one
graph for every table up to GRAPH_CONTEXT tokens (the warm-up's range), which cut an 8B model's warm-up captures
from 140 to 56 (GQA with 8 KV heads on 132 SMs: batches of 40 and more). Graphs are captured lazily on first use
(or all at once by `capture_all`, largest first) into one shared memory pool, on a side stream without the
allocator flush of `torch.cuda.graph` (its `empty_cache` per capture returns the eager run's memory to the driver
only for the next one to allocate it again), after one eager run per batch size (not per graph); every graph
reads the same static input buffers and writes its
hidden states into one static output, so only the final hidden states stay allocated.
Block tables, positions, slots and seq_lens are not uploaded: the static inputs hold each row's token id and
its index into the runner's persistent device state (executor/request_table.py; pad rows point at its all-zero
row 0). Captured inside the graph, before the forward: the `decode_positions` kernel (one launch) computes the
rows' positions, seq_lens and slots from the rows' device lengths and tables and advances the lengths, and the
gather of the rows' tables narrowed to the key's width. So a step uploads 2 x batch int64 (ids, rows) plus the
length corrections and the block ids the device lacks, in one copy, and scatters those before the replay;
eager steps compute the same inputs with the same kernel and gather the same table at the same bucketed width
(an unsplit batch's graph reads the shared width, which its attention reads only as a bound past seq_len), so
both are numerically identical. Each replay consumes one position per real row: replaying a graph again
without a new `run` moves those rows on (benchmarks that re-replay must restore `table.lens`). Capture and its
warm-up run all-padding rows, which change nothing. (Gathering outside the graph into a static table buffer
would cost a launch per step and an extra batch x width buffer per graph width; inside, the graph reads the
persistent table directly.)
On a CPU (tests) the same class runs the forward over the same padded static buffers without capturing, so
the padding and bucketing logic is exercised against the torch reference kernels.

The model's forward inside a graph must not synchronise with the host nor allocate outside the pool: models
declare this with a class attribute `supports_cuda_graphs = True` (the Llama family does).
Hybrid models (with_states): a row's recurrent-state slot is its table row (executor/state_cache.py), so the
rows' segment of the static upload doubles as the device tensor of state slots; pad rows read and write the
scratch slot 0, and one graph serves any set of requests.
Sliding-window KV cache groups (bound with the table: `bind(table, windows)`, executor/window_table.py): each
group's persistent table rows travel as a second delta in the same upload, and inside the graph each group's
tables are gathered at the key's width and its slots computed from the rows' positions.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from appliance.executor.input_batch import (
    Chunk,
    Stager,
    build_graph_rows,
    graph_stride,
    table_width,
)
from appliance.executor.request_table import DeviceBlockTable
from appliance.executor.window_table import WindowDeviceTables
from appliance.layers.attention import AttentionMetadata, SequenceStates, longest_first

log = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256
GRAPH_CONTEXT = 2048  # tokens of context the warm-up captures graphs for (wider tables: captured on first use)
MIN_WIDTH_BLOCKS = 16  # narrowest block table a graph is captured for
DELTA_ROOM = 8  # block ids per captured row that fit the static upload (more: a second, separate copy)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(sizes: list[int] | None, max_bs: int | None, max_num_seqs: int) -> list[int]:
    """Batch sizes to capture. Explicit sizes win (sorted, deduplicated, capped by max_bs when both are set);
    else 1, 2, 4, 8 then multiples of 8 up to max_bs (default min(max_num_seqs, 256)), plus max_bs itself."""
    if max_bs is not None and max_bs < 1:
        raise ValueError(f"backends.cuda_graph_max_bs must be >= 1, got {max_bs}")
    if sizes is not None:
        bad = [s for s in sizes if not isinstance(s, int) or s < 1]
        if bad or not sizes:
            raise ValueError(f"backends.cuda_graph_sizes must be a non-empty list of positive ints, got {sizes}")
        out = sorted(set(sizes))
        return [s for s in out if max_bs is None or s <= max_bs] or [min(out)]
    limit = max_bs if max_bs is not None else min(max_num_seqs, DEFAULT_MAX_BS)
    out = [s for s in (1, 2, 4, 8) if s <= limit] + list(range(16, limit + 1, 8))
    if out[-1] != limit:
        out.append(limit)
    return out


def padded_batch(sizes: list[int], n: int) -> int | None:
    """The smallest capture size >= n, or None when n is larger than every size (the step runs eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def lm_head_rows(sizes: list[int] | None, n: int) -> int:
    """Rows the LM head computes for n sampled rows: the padded batch of a decode graph (n itself without graphs
    or above every capture size), so its GEMM meets only the shapes the warm-up ran."""
    return (padded_batch(sizes, n) if sizes else None) or n


def rows_view(hidden: torch.Tensor, m: int) -> torch.Tensor | None:
    """hidden's first m rows, reading past its end into its storage when that holds them (a graph's static
    output beyond the real rows: pad rows and older steps' rows), else None."""
    if hidden.shape[0] >= m:
        return hidden[:m]
    if not hidden.is_contiguous():
        return None
    need = (hidden.storage_offset() + m * hidden.shape[1]) * hidden.element_size()
    if hidden.untyped_storage().nbytes() < need:
        return None
    return hidden.as_strided((m, hidden.shape[1]), hidden.stride())


def width_bucket(needed_blocks: int, max_blocks: int) -> int:
    """Block-table width for a batch whose longest table has needed_blocks: a power of two (>= 16), capped."""
    if needed_blocks > max_blocks:
        raise ValueError(f"a block table of {needed_blocks} blocks exceeds max_model_len ({max_blocks} blocks)")
    w = MIN_WIDTH_BLOCKS
    while w < needed_blocks:
        w *= 2
    return min(w, max_blocks)


@dataclass(frozen=True)
class GraphKey:
    batch: int
    width: int


class DecodeGraphs:
    """Captured decode forwards over static inputs; `run` fills the inputs, replays, returns hidden states.
    table: the runner's persistent block tables (`bind` attaches one later; graphs read it directly).
    unsplit_from: the smallest batch whose decode attention launch is the same at every table width (None: each
    width bucket is its own graph); such batches share the width of GRAPH_CONTEXT for narrower tables.
    Subclasses with other per-row inputs (executor/verify_graphs.py) override SEGMENTS, `_rows_upload`,
    `_lens_corrections` and `_body`."""

    SEGMENTS = 2  # int64 segments of graph_stride(batch) per step in the upload: [ids | rows]

    def __init__(self, forward: Forward, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 sizes: list[int], max_blocks: int, block_size: int, table: DeviceBlockTable | None = None,
                 unsplit_from: int | None = None, with_states: bool = False) -> None:
        self.forward, self.device, self.sizes = forward, device, sizes
        self.with_states = with_states  # a hybrid model: the rows also name their state slots
        self.max_blocks, self.block_size = max_blocks, block_size
        self.unsplit_from = unsplit_from
        self.shared_width = width_bucket(min(-(-GRAPH_CONTEXT // block_size), max_blocks), max_blocks)
        top = graph_stride(sizes[-1])
        self.cuda = device.type == "cuda"
        # the upload: [ids | rows] of the key's stride, the length corrections (at most one per row), then room
        # for the step's block delta; positions, slots and seq_lens are written on the device (DeviceBlockTable.
        # advance) into their own static buffers, at 32-byte aligned offsets
        self.buf = torch.zeros((self.SEGMENTS + 2) * top + 2 * DELTA_ROOM * top, dtype=torch.int64, device=device)
        # two pinned uploads taking turns: a fill waits for the copy two fills back, not the latest one (which,
        # with a step launched ahead of the step in flight's read, may sit behind that whole step)
        self.hosts = [torch.zeros(self.buf.numel(), dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self._turn = 0
        self.computed = torch.zeros(2 * top, dtype=torch.int64, device=device)  # [positions | slots]
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(sizes[-1], hidden_size, dtype=dtype, device=device)
        self._no_prefill = torch.zeros(1, dtype=torch.int32, device=device)
        self.graphs: dict[GraphKey, Callable[[], None]] = {}  # replay functions
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.stream = torch.cuda.Stream(device) if self.cuda else None  # captures run on it
        self.eager_sizes: set[int] = set()  # batch sizes whose capture had its eager run
        self._copies: list[torch.cuda.Event | None] = [None, None]
        self._overflow = Stager(device)  # a delta larger than the room (a step of many new one-token requests)
        self.table: DeviceBlockTable | None = None
        self.windows: WindowDeviceTables | None = None  # the sliding groups' tables (None: one group)
        self.last_key: GraphKey | None = None
        if table is not None:
            self.bind(table)

    def bind(self, table: DeviceBlockTable, windows: WindowDeviceTables | None = None) -> None:
        """Read this persistent table and these sliding groups' tables (a no-op when bound to them); graphs
        captured for others are dropped."""
        if table is self.table and windows is self.windows:
            return
        if table.width < self.max_blocks:
            raise ValueError(f"a block table of {table.width} columns is narrower than max_model_len's "
                             f"{self.max_blocks} blocks")
        self.table, self.windows = table, windows
        self.graphs.clear()

    def key_for(self, decodes: list[Chunk]) -> GraphKey | None:
        batch = padded_batch(self.sizes, len(decodes))
        if batch is None:
            return None
        return GraphKey(batch, self.width_for(batch, width_bucket(table_width(decodes), self.max_blocks)))

    def width_for(self, batch: int, width: int) -> int:
        """The graph width of a padded batch whose tables need `width` (a bucket): shared_width for narrower
        tables of an unsplit batch, else the bucket itself."""
        if self.unsplit_from is not None and batch >= self.unsplit_from:
            return max(width, self.shared_width)
        return width

    def _body(self, key: GraphKey) -> None:
        """What a graph runs: the rows' positions, slots and seq_lens from the device lengths (advancing them),
        the rows' tables gathered, the forward into the static output."""
        assert self.table is not None
        b, w, s = key.batch, key.width, graph_stride(key.batch)
        rows, top = self.buf[s : s + b], self.seq_lens.shape[0]
        positions, slots = self.computed[:b], self.computed[top : top + b]
        self.table.advance(rows, self.block_size, positions, slots, self.seq_lens[:b])
        meta = AttentionMetadata(
            slot_mapping=slots, num_decode_tokens=b, decode_block_tables=self.table.gather(rows, w),
            decode_seq_lens=self.seq_lens[:b],
            prefill_cu_seqlens=self._no_prefill, prefill_seq_lens=self._no_prefill[:0],
            prefill_block_tables=self._no_prefill[:0].view(0, 1), decode_order=longest_first(self.seq_lens[:b]),
            states=SequenceStates(rows, [], [], [0]) if self.with_states else None,
            windows=() if self.windows is None else self.windows.decode_windows(rows, positions, slots, w,
                                                                                self.block_size))
        self.hidden[:b].copy_(self.forward(self.buf[:b], positions, meta))

    def _fill(self, decodes: list[Chunk], key: GraphKey) -> None:
        """Upload [ids | rows], the length corrections and the block delta in one copy, then scatter the
        corrections and the delta into the table (before the replay, whose kernels read them)."""
        assert self.table is not None
        turn, self._turn = self._turn, 1 - self._turn
        copied = self._copies[turn]
        if copied is not None:
            copied.synchronize()  # the pinned buffer is about to be overwritten
        pinned = self.hosts[turn]
        host = pinned.numpy()
        self._rows_upload(decodes, key, host)
        index, blocks = self.table.delta(c.state for c in decodes)
        corrections = self._lens_corrections(decodes)
        at = self.SEGMENTS * graph_stride(key.batch)
        n, m, k = at, corrections.shape[1], index.shape[0]
        host[n : n + 2 * m] = corrections.reshape(-1)  # at most one per row: always fits
        n += 2 * m
        inline = n + 2 * k <= host.shape[0]
        if inline:
            host[n : n + k], host[n + k : n + 2 * k] = index, blocks
            n += 2 * k
        full_end, windows = n, self._window_delta(decodes)  # the sliding groups' delta after the full one's
        w_inline = windows is not None and n + windows.shape[0] <= host.shape[0]
        if w_inline:
            host[n : n + windows.shape[0]] = windows
            n += windows.shape[0]
        self.buf[:n].copy_(pinned[:n], non_blocking=self.cuda)
        if self.cuda:
            self._copies[turn] = torch.cuda.Event()
            self._copies[turn].record()
        if not inline:
            delta = self._overflow.send(np.concatenate([index, blocks]))
            self.table.apply(delta[:k], delta[k:])
        elif k:
            self.table.apply(self.buf[full_end - 2 * k : full_end - k], self.buf[full_end - k : full_end])
        if windows is not None:
            assert self.windows is not None
            sent = self.buf[full_end:n] if w_inline else self._overflow.send(windows)
            self.windows.apply(sent[: windows.shape[0] // 2], sent[windows.shape[0] // 2 :])
        self.table.set_lens(self.buf[at : at + m], self.buf[at + m : at + 2 * m])

    def _window_delta(self, decodes: list[Chunk]) -> np.ndarray | None:
        """[index | block ids] of the sliding groups' entries the device lacks, or None when there are none."""
        if self.windows is None:
            return None
        index, blocks = self.windows.delta(c.state for c in decodes)
        return np.concatenate([index, blocks]) if index.shape[0] else None

    def _rows_upload(self, decodes: list[Chunk], key: GraphKey, host: np.ndarray) -> None:
        """The step's per-row segments of the upload (SEGMENTS of graph_stride(key.batch))."""
        build_graph_rows(decodes, self.block_size, key.batch, key.width, host)

    def _lens_corrections(self, decodes: list[Chunk]) -> np.ndarray:
        """[2, m] (table row, length) corrections, at most one per request (DeviceBlockTable.lens_delta)."""
        assert self.table is not None
        return self.table.lens_delta(decodes)

    def capture(self, key: GraphKey) -> None:
        if key in self.graphs:
            return
        if self.table is None:
            raise RuntimeError("DecodeGraphs: bind() the runner's block table before capturing")
        if not self.cuda:
            self.graphs[key] = lambda: self._body(key)
            return
        self._fill([], key)  # all padding: the warm-up and the capture store nothing in the KV cache
        if key.batch not in self.eager_sizes:
            # one eager run per batch size settles its first uses (cuBLAS's shapes, the allocator) outside a
            # capture; another width of that size differs only in the decode attention's split, and the graphs'
            # Triton variants (programmatic dependent launch) compile inside the capture anyway
            self._body(key)
            self.eager_sizes.add(key.batch)
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        assert self.stream is not None
        with torch.cuda.stream(self.stream):
            graph.capture_begin(pool=self.pool)
            try:
                self._body(key)
            finally:  # a failed forward still ends the capture it is in, or the stream stays unusable
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.graphs[key] = graph.replay
        log.debug("captured decode graph batch=%d width=%d", key.batch, key.width)

    def keys_up_to(self, max_context: int) -> list[GraphKey]:
        """The graph of every size for every width bucket up to max_context tokens (one per unsplit batch up to
        GRAPH_CONTEXT), largest first (pool reuse)."""
        widths = sorted({width_bucket(min(b, self.max_blocks), self.max_blocks)
                         for b in _powers(MIN_WIDTH_BLOCKS, -(-max_context // self.block_size))}, reverse=True)
        keys = [GraphKey(b, self.width_for(b, w)) for w in widths for b in reversed(self.sizes)]
        return list(dict.fromkeys(keys))  # shared widths repeat a key: keep its first (widest) place

    def capture_all(self, max_context: int, on_captured: Callable[[], None] | None = None) -> int:
        """Capture keys_up_to(max_context), calling on_captured after each; returns how many graphs exist."""
        for key in self.keys_up_to(max_context):
            self.capture(key)
            if on_captured is not None:
                on_captured()
        return len(self.graphs)

    def run(self, decodes: list[Chunk], key: GraphKey,
            fix_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states [len(decodes), hidden] of a decode-only step (a view of the static output).
        fix_ids(ids) may rewrite the uploaded input ids on the device before the replay (tokens in flight)."""
        if key not in self.graphs:
            self.capture(key)
        self._fill(decodes, key)
        if fix_ids is not None:
            fix_ids(self.buf[: len(decodes)])
        self.graphs[key]()
        self.last_key = key  # benchmarks replay it to time the GPU side alone
        return self.hidden[: len(decodes)]


def _powers(start: int, stop: int) -> list[int]:
    out = [start]
    while out[-1] < stop:
        out.append(out[-1] * 2)
    return out


def decode_unsplit_from(layers: list[torch.nn.Module], device: torch.device) -> int | None:
    """The smallest batch whose decode launch is the same at every table width in every layer (each layer's
    `decode_unsplit_from`; None when any layer lacks one, as MLA does). Every rank computes the same value: the
    same model shard on the same kind of GPU, so ranks keep capturing and replaying the same keys."""
    found = [getattr(layer, "decode_unsplit_from", lambda _d: None)(device) for layer in layers]
    return None if not found or None in found else max(found)


def graph_settings(config: object, model: torch.nn.Module, device: torch.device,
                   backend: str = "triton") -> list[int] | None:
    """Capture sizes, or None when graphs are off (CPU, enforce_eager, the torch reference kernels, the flashinfer
    backend, or a model that does not support them)."""
    b = config.backends  # type: ignore[attr-defined]
    if device.type != "cuda" or b.enforce_eager:
        return None
    if backend == "torch":  # the reference kernels index with masks, which reads device memory back
        log.info("attention backend torch: decode runs eagerly (its reference kernels cannot be captured)")
        return None
    if backend == "flashinfer":  # its wrappers plan on the host from each step's lengths (kernels/flashinfer)
        log.info("attention backend flashinfer: decode runs eagerly (its per-step plan reads the sequence lengths "
                 "back to the host; capture through its CUDA-graph wrappers is not wired)")
        return None
    if not getattr(model, "supports_cuda_graphs", False):
        log.info("%s does not declare CUDA graph support: decode runs eagerly", type(model).__name__)
        return None
    # Tensor and expert parallelism: the all-reduces (one-shot over CUDA IPC buffers, or NCCL) are captured into
    # the graphs; under ep a rank's non-local experts weigh 0 and one all-reduce sums the ranks, so the expert path
    # never syncs with the host either (tests/test_ep_graphs.py checks captured == eager on two GPUs).
    # Every rank must replay the same graph each step, or the collectives inside would pair up wrongly and hang:
    # they do, because every rank receives the same StepPlan and the graph key (padded batch, table-width
    # bucket) is a function of the plan alone; capture_all captures the same keys in the same order everywhere.
    return capture_sizes(b.cuda_graph_sizes, b.cuda_graph_max_bs,
                         config.scheduler.max_num_seqs)  # type: ignore[attr-defined]
