"""A drafter's chain of one-token steps, replayed from one CUDA graph.

After the catch-up forward drafts each request's first token, num_steps - 1 more one-token steps of the drafter (the
EAGLE / EAGLE-3 head, the MTP layer, the standalone draft model: the speculator's `draft_step`) feed each draft
back. Draft i + 1 of a request sits at first_pos + i, so the whole chain is one fixed-shape body: the upload holds
each row's table row, first position and limit, every step's positions, slots and seq_lens are computed inside
the body from them and the tables gathered once from the runner's persistent device table (the step's block deltas
are already there), and the drafts stay on the device from step to step and come back in one copy at the end. The
first positions come from the host, and the speculator waits for the drafts only when it next reads them (the next
step's start: the chain runs on the GPU while the engine plans that step); or, after a step whose verifications
were all decided on the device (device_proposal.py), from the device lengths that verdict set (`launch(...,
first_pos=None)`): the chain is then queued before the host knows how many tokens each request kept, and its
drafts arrive with the verdict. A graph is captured per (padded batch, table-width bucket), as the decode graphs
are. A row whose next position is past its block table or max_model_len (`Speculator.draft_limit`) stores nothing
from there on (slot -1, seq_len 0: attention reads nothing) and its later drafts are dropped on the host; pad rows
are the same with table row 0. Batches above the captured sizes, a CPU (tests) and a drafter whose forward cannot
be captured run the same body uncaptured over the same static buffers, so the speculative parity tests exercise it.
"""
from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

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
        self.buf = torch.zeros(3 * top, dtype=torch.int64, device=self.device)  # [rows | first positions | limits]
        # uploads and draft copies in two pinned buffers each, taking turns: a chain may launch before the previous
        # one is read (verify_ahead.py), and a fill then waits for the copy two launches back only
        self.hosts = [torch.zeros(self.buf.numel(), dtype=torch.int64, pin_memory=self.cuda) for _ in range(2)]
        self._copies: list[torch.cuda.Event | None] = [None, None]
        self.tokens = torch.zeros(sizes[-1], dtype=torch.int64, device=self.device)
        self.hidden = (torch.zeros(sizes[-1], hidden_size, dtype=dtype, device=self.device)
                       if hidden_size is not None else None)
        self.seq_lens = torch.zeros(max(n, 1), sizes[-1], dtype=torch.int32, device=self.device)
        self.out = torch.zeros(sizes[-1], spec.num_steps, dtype=torch.int64, device=self.device)
        self.reads = [torch.zeros(sizes[-1], spec.num_steps, dtype=torch.int64, pin_memory=self.cuda)
                      for _ in range(2)]
        self._reads: list[torch.cuda.Event | None] = [None, None]
        self._turn, self._fill_turn = 0, 0  # the draft copies', the uploads'
        self._no_prefill = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.graphs: dict[GraphKey, Callable[[], None]] = {}
        self.pool = pool if pool is not None or not self.cuda else torch.cuda.graph_pool_handle()
        self.last_key: GraphKey | None = None

    def _segments(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The upload's [rows | first positions | limits] of this key's batch."""
        b, s = key.batch, graph_stride(key.batch)
        return self.buf[:b], self.buf[s : s + b], self.buf[2 * s : 2 * s + b]

    def _place(self, tables: torch.Tensor, pos: torch.Tensor, limits: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Positions, slots and seq_lens of one chain step's rows at `pos`; a row at or past its limit (and
        padding: limit 0) stores nothing and reads nothing."""
        ok = pos < limits
        col = torch.clamp(pos // self.block_size, max=tables.shape[1] - 1)
        block = tables.gather(1, col.view(-1, 1)).view(-1).to(torch.int64)
        slots = torch.where(ok, block * self.block_size + pos % self.block_size, -1)
        return torch.where(ok, pos, 0), slots, torch.where(ok, pos + 1, 0)

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """Argmax drafts as target ids."""
        tokens = logits.argmax(dim=-1)
        return tokens if self.id_map is None else self.id_map[tokens]

    def _body(self, key: GraphKey, pick: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """The chain over the static inputs; `pick` chooses drafts from logits (default: greedy)."""
        step = self._step()
        assert step is not None, "the speculator that owns these chains is gone"
        b = key.batch
        rows, first, limits = self._segments(key)
        tables = self.table.gather(rows, key.width)
        tokens, hidden = self.tokens[:b], self.hidden[:b] if self.hidden is not None else None
        self.out[:b, 0].copy_(tokens)
        for i in range(self.num_steps - 1):
            positions, slots, lens = self._place(tables, first + i, limits)
            seq_lens = self.seq_lens[i, :b]
            seq_lens.copy_(lens)
            meta = AttentionMetadata(
                slot_mapping=slots, num_decode_tokens=b, decode_block_tables=tables, decode_seq_lens=seq_lens,
                prefill_cu_seqlens=self._no_prefill, prefill_seq_lens=self._no_prefill[:0],
                prefill_block_tables=self._no_prefill[:0].view(0, 1), decode_order=longest_first(seq_lens))
            logits, hidden = step(tokens, positions, meta, hidden)
            tokens = (pick or self.greedy)(logits)
            self.out[:b, i + 1].copy_(tokens)

    def _fill(self, states: list[RequestState], first_pos: list[int] | None, limits: list[int], key: GraphKey
              ) -> None:
        """Upload [rows | first positions | limits] (padding: row 0, limit 0); first_pos None: the first
        positions are the rows' device lengths, gathered on the device."""
        turn, self._fill_turn = self._fill_turn, 1 - self._fill_turn
        if self._copies[turn] is not None:
            self._copies[turn].synchronize()  # the pinned buffer is about to be overwritten
        s, n = graph_stride(key.batch), len(states)
        pinned = self.hosts[turn]
        v = pinned.numpy()[: 3 * s].reshape(3, s)
        v[:] = 0
        v[0, :n] = [st.table_row for st in states]
        if first_pos is not None:
            v[1, :n] = first_pos
        v[2, :n] = limits
        self.buf[: 3 * s].copy_(pinned[: 3 * s], non_blocking=self.cuda)
        if self.cuda:
            self._copies[turn] = torch.cuda.Event()
            self._copies[turn].record()
        if first_pos is None:
            self.buf[s : s + n].copy_(self.table.lens.index_select(0, self.buf[:n]))

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

    def launch(self, states: list[RequestState], first: torch.Tensor, first_pos: list[int] | None, hidden: Any,
               limits: list[int]) -> PendingChain:
        """Start the chains of these states: `first` ([n] on the device) is each one's first draft, then one
        per chain step whose position (first_pos + i) is below the state's limit; first_pos None: each row's
        device length (`_fill`), which the caller tells PendingChain.drafts when it knows it. The drafts come
        back to pinned memory behind the kernels; PendingChain.drafts() waits for them (the chain's one sync)."""
        n = len(states)
        turn, self._turn = self._turn, 1 - self._turn
        if self._reads[turn] is not None:
            self._reads[turn].synchronize()  # the drafts of the chain before the previous one left this buffer
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
        host = self.reads[turn].view(-1)[: out.numel()].view(out.shape)  # contiguous: one plain copy
        host.copy_(out, non_blocking=self.cuda)
        read = self._reads[turn] = torch.cuda.Event() if self.cuda else None
        if read is not None:
            read.record()
        return PendingChain(host, read, self.num_steps, limits, first_pos, out)

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
        return [row[:k] for row, k in zip(out.tolist(), chain_counts(self.num_steps, first_pos, limits))]


def chain_counts(num_steps: int, first_pos: list[int], limits: list[int]) -> list[int]:
    """Drafts each chain keeps: the first, then one per step whose position is below the row's limit."""
    return [1 + max(0, min(num_steps - 1, lim - p)) for p, lim in zip(first_pos, limits)]


@dataclass(frozen=True)
class PendingChain:
    """A launched chain's drafts, on their way to the host: counts are known once the first positions are
    (at launch from the host, else from the verdict read), values after the copy."""

    host: torch.Tensor  # [n, num_steps] int64, pinned on a GPU
    copied: torch.cuda.Event | None
    num_steps: int
    limits: list[int]
    first_pos: list[int] | None  # None: placed from the device lengths, told to `drafts`
    out: torch.Tensor | None = None  # [n, num_steps] on the device, until the next chain launches

    @property
    def counts(self) -> list[int]:
        assert self.first_pos is not None, "a chain placed on the device counts its drafts once it is read"
        return chain_counts(self.num_steps, self.first_pos, self.limits)

    def drafts(self, first_pos: list[int] | None = None) -> list[list[int]]:
        if self.copied is not None:
            self.copied.synchronize()
        first = first_pos if first_pos is not None else self.first_pos
        assert first is not None, "a chain placed on the device is read with its first positions"
        return [row[:k] for row, k in zip(self.host.tolist(), chain_counts(self.num_steps, first, self.limits))]


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
