"""A drafter's chain of one-token steps, replayed from one CUDA graph.

After the catch-up forward drafts each request's first token, num_steps - 1 more one-token steps of the drafter (the
EAGLE / EAGLE-3 head, the MTP layer, the standalone draft model: the speculator's `draft_step`) feed each draft
back. Every step's positions are known before the chain starts (draft i + 1 of a request sits at first_pos + i), so
the whole chain is one fixed-shape body: its rows' positions, slots and seq_lens for every step travel in one
upload, the tables are gathered once from the runner's persistent device table (the step's block deltas are already
there), and the drafts stay on the device from step to step and come back in one copy at the end, which the
speculator waits for only when it next reads its drafts (the next step's start): the chain runs on the GPU while the
engine plans that step, so the verification's samples are a step's one wait. A graph is captured per (padded batch,
table-width bucket), as the decode graphs are. A row whose next position is past its block table or max_model_len
(`Speculator.draft_limit`) stores nothing from there on (slot -1, seq_len 0: attention reads nothing) and its later
drafts are dropped on the host; pad rows are the same with table row 0. Batches above the captured sizes, a CPU
(tests) and a drafter whose forward cannot be captured run the same body uncaptured over the same static buffers, so
the speculative parity tests exercise it.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from appliance.executor.cuda_graph import GRAPH_CONTEXT, GraphKey, capture_sizes, padded_batch, width_bucket
from appliance.executor.input_batch import graph_stride
from appliance.executor.request_table import DeviceBlockTable, RequestState
from appliance.layers.attention import AttentionMetadata, longest_first

if TYPE_CHECKING:
    from appliance.executor.speculative import Speculator

log = logging.getLogger(__name__)

# (tokens [B] int64, positions [B] int64, metadata, the drafter's hidden rows or None) -> (its logits, hidden)
DraftStep = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, Any], tuple[torch.Tensor, Any]]


class ChainGraphs:
    """The draft chains of one speculator (module docstring). `sizes`: batch buckets up to max_num_seqs;
    `captured`: the largest batch captured (0: none, every chain runs uncaptured)."""

    def __init__(self, spec: Speculator, hidden_size: int | None, dtype: torch.dtype, sizes: list[int],
                 captured: int, max_blocks: int, block_size: int, table: DeviceBlockTable,
                 pool: Any = None, id_map: torch.Tensor | None = None) -> None:
        r = spec.runner
        self.device = r.device
        # a weak method: the speculator holds this object, and a cycle would only be freed by the collector
        self._step = weakref.WeakMethod(spec.draft_step)
        self.num_steps, self.sizes, self.captured = spec.num_steps, sizes, captured
        self.id_map = id_map  # the drafter's vocabulary -> the target's (an EAGLE-3 head's), None: the same
        self.max_blocks, self.block_size, self.table = max_blocks, block_size, table
        self.cuda = self.device.type == "cuda"
        top, n = graph_stride(sizes[-1]), spec.num_steps - 1
        self.buf = torch.zeros((1 + 3 * n) * top, dtype=torch.int64, device=self.device)  # rows, then per step
        self.host = torch.zeros(self.buf.numel(), dtype=torch.int64, pin_memory=self.cuda)
        self.tokens = torch.zeros(sizes[-1], dtype=torch.int64, device=self.device)
        self.hidden = (torch.zeros(sizes[-1], hidden_size, dtype=dtype, device=self.device)
                       if hidden_size is not None else None)
        self.seq_lens = torch.zeros(max(n, 1), sizes[-1], dtype=torch.int32, device=self.device)
        self.out = torch.zeros(sizes[-1], spec.num_steps, dtype=torch.int64, device=self.device)
        self.read = torch.zeros(sizes[-1], spec.num_steps, dtype=torch.int64, pin_memory=self.cuda)
        self._read: torch.cuda.Event | None = None
        self._no_prefill = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.graphs: dict[GraphKey, Callable[[], None]] = {}
        self.pool = pool if pool is not None or not self.cuda else torch.cuda.graph_pool_handle()
        self._copied: torch.cuda.Event | None = None
        self.last_key: GraphKey | None = None

    def _segments(self, key: GraphKey) -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
        b, s = key.batch, graph_stride(key.batch)
        steps = [tuple(self.buf[(1 + 3 * i + j) * s : (1 + 3 * i + j) * s + b] for j in range(3))
                 for i in range(self.num_steps - 1)]
        return self.buf[:b], steps

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Argmax drafts as target ids."""
        tokens = logits.argmax(dim=-1)
        return tokens if self.id_map is None else self.id_map[tokens]

    def _body(self, key: GraphKey, pick: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """The chain over the static inputs; `pick` chooses drafts from logits (default: greedy)."""
        step = self._step()
        assert step is not None, "the speculator that owns these chains is gone"
        b = key.batch
        rows, steps = self._segments(key)
        tables = self.table.gather(rows, key.width)
        tokens, hidden = self.tokens[:b], self.hidden[:b] if self.hidden is not None else None
        self.out[:b, 0].copy_(tokens)
        for i, (positions, slots, lens) in enumerate(steps):
            seq_lens = self.seq_lens[i, :b]
            seq_lens.copy_(lens)
            meta = AttentionMetadata(
                slot_mapping=slots, num_decode_tokens=b, decode_block_tables=tables, decode_seq_lens=seq_lens,
                prefill_cu_seqlens=self._no_prefill, prefill_seq_lens=self._no_prefill[:0],
                prefill_block_tables=self._no_prefill[:0].view(0, 1), decode_order=longest_first(seq_lens))
            logits, hidden = step(tokens, positions, meta, hidden)
            tokens = (pick or self.greedy)(logits)
            self.out[:b, i + 1].copy_(tokens)

    def _fill(self, states: list[RequestState], first_pos: list[int], limits: list[int], key: GraphKey) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffer is about to be overwritten
        s, bs = graph_stride(key.batch), self.block_size
        host = self.host.numpy()
        n = len(states)
        host[:s] = 0
        host[:n] = [st.table_row for st in states]
        first = np.asarray(first_pos, dtype=np.int64)
        limit = np.asarray(limits, dtype=np.int64)
        width = max((len(st.block_ids) for st in states), default=1)
        tables = np.zeros((n, width), dtype=np.int64)
        for j, st in enumerate(states):
            blocks = st.block_array()
            tables[j, : blocks.shape[0]] = blocks
        for i in range(self.num_steps - 1):
            v = host[(1 + 3 * i) * s : (4 + 3 * i) * s].reshape(3, s)
            v[0], v[1], v[2] = 0, -1, 0  # padding: position 0, stored nowhere, reads nothing
            pos = first + i
            ok = pos < limit
            safe = np.where(ok, pos, 0)
            v[0, :n] = safe
            v[1, :n] = np.where(ok, tables[np.arange(n), np.minimum(safe // bs, width - 1)] * bs + safe % bs, -1)
            v[2, :n] = np.where(ok, pos + 1, 0)
        size = (1 + 3 * (self.num_steps - 1)) * s
        self.buf[:size].copy_(self.host[:size], non_blocking=self.cuda)
        if self.cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def capture(self, key: GraphKey) -> None:
        if key in self.graphs:
            return
        if not self.cuda or key.batch > self.captured:
            self.graphs[key] = lambda: self._body(key)
            return
        self._fill([], [], [], key)  # all padding: nothing is stored
        self._body(key)  # compiles kernels and settles the allocator outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self._body(key)
        self.graphs[key] = graph.replay

    def keys_up_to(self, max_context: int) -> list[GraphKey]:
        """The captured batch sizes for every width bucket up to max_context tokens, largest first."""
        widths, w = [], width_bucket(1, self.max_blocks)
        while True:
            widths.append(w)
            if w * self.block_size >= max_context or w >= self.max_blocks:
                break
            w = width_bucket(w + 1, self.max_blocks)
        return [GraphKey(b, w) for w in reversed(widths) for b in reversed(self.sizes) if b <= self.captured]

    def launch(self, states: list[RequestState], first: torch.Tensor, first_pos: list[int], hidden: Any,
               limits: list[int]) -> PendingChain:
        """Start the chains of these states: `first` ([n] on the device) is each one's first draft, then one
        per chain step whose position (first_pos + i) is below the state's limit. The drafts come back to
        pinned memory behind the kernels; PendingChain.drafts() waits for them (the chain's one sync)."""
        n = len(states)
        counts = [1 + max(0, min(self.num_steps - 1, lim - p)) for p, lim in zip(first_pos, limits)]
        if self._read is not None:
            self._read.synchronize()  # the previous chain's drafts left the pinned buffer
        if self.num_steps > 1:
            batch = padded_batch(self.sizes, n)
            assert batch is not None, f"a chain of {n} rows exceeds the {self.sizes[-1]} the buffers hold"
            key = GraphKey(batch, width_bucket(max(len(s.block_ids) for s in states), self.max_blocks))
            if key not in self.graphs:
                self.capture(key)
            self._fill(states, first_pos, limits, key)
            self.tokens[:n].copy_(first)
            if self.hidden is not None:
                self.hidden[:n].copy_(hidden)
            self.graphs[key]()
            self.last_key = key
            out = self.out[:n]
        else:
            out = first.view(n, 1)
        host = self.read.view(-1)[: out.numel()].view(out.shape)  # contiguous: one plain copy
        host.copy_(out, non_blocking=self.cuda)
        self._read = torch.cuda.Event() if self.cuda else None
        if self._read is not None:
            self._read.record()
        return PendingChain(host, self._read, counts)

    def run(self, states: list[RequestState], first: torch.Tensor, first_pos: list[int], hidden: Any,
            limits: list[int]) -> list[list[int]]:
        """launch(...).drafts()."""
        return self.launch(states, first, first_pos, hidden, limits).drafts()

    def run_drawn(self, states: list[RequestState], first: torch.Tensor, first_pos: list[int], hidden: Any,
                  limits: list[int], pick: Callable[[torch.Tensor], torch.Tensor]) -> list[list[int]]:
        """The chain uncaptured over exactly these rows, `pick` choosing each step's drafts (a draw of the
        drafter's q for some of them: speculative_rejection.py DraftPicker); waits for the drafts."""
        n = len(states)
        out = first.view(n, 1)
        if self.num_steps > 1:
            key = GraphKey(n, width_bucket(max(len(s.block_ids) for s in states), self.max_blocks))
            self._fill(states, first_pos, limits, key)
            self.tokens[:n].copy_(first)
            if self.hidden is not None:
                self.hidden[:n].copy_(hidden)
            self._body(key, pick)
            out = self.out[:n]
        counts = [1 + max(0, min(self.num_steps - 1, lim - p)) for p, lim in zip(first_pos, limits)]
        return [row[:k] for row, k in zip(out.tolist(), counts)]


@dataclass(frozen=True)
class PendingChain:
    """A launched chain's drafts, on their way to the host: counts are known at once, values after the copy."""

    host: torch.Tensor  # [n, num_steps] int64, pinned on a GPU
    copied: torch.cuda.Event | None
    counts: list[int]

    def drafts(self) -> list[list[int]]:
        if self.copied is not None:
            self.copied.synchronize()
        return [row[:k] for row, k in zip(self.host.tolist(), self.counts)]


def make_chain_graphs(spec: Speculator, hidden_size: int | None, drafter: torch.nn.Module,
                      drafter_backend: str, id_map: torch.Tensor | None = None) -> ChainGraphs:
    """The speculator's chains: buffers for max_num_seqs rows, graphs captured at start-up on a GPU for the
    batches verification graphs cover (verify_graphs.verify_batches), when the drafter's forward can be
    captured."""
    from appliance.executor.cuda_graph import graph_settings
    from appliance.executor.startup import STARTUP
    from appliance.executor.verify_graphs import verify_batches

    r = spec.runner
    c = r.config
    sizes = capture_sizes(None, c.scheduler.max_num_seqs, c.scheduler.max_num_seqs)  # every batch fits one
    batches = verify_batches(r) or []
    can = r.device.type == "cuda" and graph_settings(c, drafter, r.device, drafter_backend) is not None
    captured = batches[-1] if can and batches else 0
    pool = r.graphs.pool if r.graphs is not None else None
    chains = ChainGraphs(spec, hidden_size, r.dtype, sizes, captured, r.max_blocks, r.block_size, r.block_table,
                         pool, id_map)
    if captured and spec.num_steps > 1:
        keys = chains.keys_up_to(min(GRAPH_CONTEXT, r.max_model_len))
        with STARTUP.phase("capturing draft graphs", len(keys)), torch.inference_mode():
            for key in keys:
                chains.capture(key)
                STARTUP.advance()
        log.info("speculative decoding: %d draft-chain graphs captured (batches up to %d)", len(keys), captured)
    return chains
