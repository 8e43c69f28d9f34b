"""Piecewise CUDA graphs for the eager (mixed / prefill) steps: the forward captured in pieces between its
attention calls, which run eagerly on each step's own metadata.

Why: an eager Qwen3-0.6B step of 8,192 tokens makes ~170 Triton and ~112 cuBLAS launches plus their Python, 19-31
ms of host time against ~25 ms of device time (measured on an H100); on a slower host the device waits.
Replayed, a piece is one launch. vLLM does the same by default (cudagraph_mode PIECEWISE, its compiled graph split
at the attention op); here the split comes from `Attention.attend` itself: while a forward is captured
(`attention_breaks`), each attention call copies q into a shared static buffer, ends the current graph, and hands
back the static buffer the eager attention will write at replay; the next graph starts there.

Token counts are padded up to a bucket (`bucket_for`). Padded rows carry a valid token id, a valid position and
slot -1 (no KV store); attention never reads them (it runs on the step's own metadata, rows [0, T)), so their
values in the static attention output are stale but finite, and no real row reads a padded one.
Sliding-window KV cache groups (engine/kv_groups.py): their layers store K/V inside the pieces through their group's
slots, so each group has a static slot buffer of its own beside the full group's, staged the same way (its
tables are read only by the eager attention, from the step's metadata).

Settings: backends.piecewise_cuda_graph (on by default) and backends.piecewise_cuda_graph_max_tokens; every bucket
is captured at warm-up, largest first, into one pool (the smaller ones reuse its blocks). On a CPU (tests) run()
keeps everything but the graphs (`_emulate`), so the padding and the hand-over are checked against eager there.
"""
from __future__ import annotations

import bisect
import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from appliance.engine.config import StepTokens
from appliance.layers import attention as attention_layer
from appliance.layers.attention import Attention, AttentionMetadata, PieceBreak, WindowTables

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig

log = logging.getLogger(__name__)

SMALL_BUCKETS = (16, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
# Above 512 tokens each bucket is at most 1/8 larger than the one before (multiples of 64): a compute-bound step
# (Llama-8B prefill) pays at most 12.5% padding, and 27 more buckets reach 8,192 tokens. Buckets of 512 cost the 8B's
# mixed serving steps up to 50% (a 1,030-token step ran as 1,536).
GROWTH, ALIGN = 1.125, 64


@functools.cache
def buckets(max_tokens: int) -> tuple[int, ...]:
    """Every padded token count up to max_tokens, ascending; the last is max_tokens itself."""
    out = [b for b in SMALL_BUCKETS if b < max_tokens]
    b = SMALL_BUCKETS[-1]
    while (b := max(b + ALIGN, int(b * GROWTH) // ALIGN * ALIGN)) < max_tokens:
        out.append(b)
    return (*out, max_tokens)


def bucket_for(tokens: int, max_tokens: int) -> int | None:
    """The padded token count of an eager step, or None when it exceeds max_tokens (it then runs eagerly)."""
    if tokens <= 0 or tokens > max_tokens:
        return None
    ladder = buckets(max_tokens)
    return ladder[bisect.bisect_left(ladder, tokens)]


def all_buckets(max_tokens: int) -> list[int]:
    """Every bucket, largest first (captured in that order: the smaller ones reuse the pool blocks the largest
    freed)."""
    return list(reversed(buckets(max_tokens)))


@dataclass
class Pieces:
    """One bucket's captured forward: graphs[i] runs up to layer i's attention; the last one to the end."""
    graphs: list[Any] = field(default_factory=list)
    layers: list[Attention] = field(default_factory=list)


class _Recorder:
    """What Attention.attend calls while a forward is being captured in pieces."""

    def __init__(self, owner: PiecewiseGraphs, tokens: int, capture: bool) -> None:
        self.owner, self.tokens, self.capture = owner, tokens, capture
        self.pieces = Pieces()
        self.graph: Any = None

    def begin(self) -> None:
        if self.capture:
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=self.owner.pool)

    def end(self) -> None:
        if self.capture:
            self.graph.capture_end()
            self.pieces.graphs.append(self.graph)

    def attention(self, layer: Attention, q: torch.Tensor) -> torch.Tensor:
        t = self.tokens
        qbuf = self.owner.q_buffer(layer, t)
        qbuf.copy_(q.reshape(t, -1))  # inside the piece: the eager attention reads it at replay
        self.end()
        self.pieces.layers.append(layer)
        out = self.owner.out_buffer(layer, t)
        self.begin()
        return out


@contextlib.contextmanager
def attention_breaks(hook: PieceBreak) -> Iterator[None]:
    """While inside, every Attention.attend call goes to `hook`, which ends the current piece
    (layers/attention.py)."""
    previous = attention_layer.set_piece_break(hook)
    if previous is not None:
        attention_layer.set_piece_break(previous)
        raise RuntimeError("piecewise capture: a capture is already in progress")
    try:
        yield
    finally:
        attention_layer.set_piece_break(None)


class PiecewiseGraphs:
    """The eager steps' forward as CUDA-graph pieces per token bucket, with eager attention between them."""

    def __init__(self, model: torch.nn.Module, device: torch.device, dtype: torch.dtype, max_tokens: int,
                 window_groups: int = 0) -> None:
        """window_groups: the runner's sliding-window KV cache groups (their layers' kv_group 1..n)."""
        self.model, self.device, self.dtype, self.max_tokens = model, device, dtype, max_tokens
        self.ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.slots = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.window_slots = [torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
                             for _ in range(window_groups)]
        self.cuda = device.type == "cuda"  # elsewhere (tests) run() emulates the pieces without graphs
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pieces: dict[int, Pieces] = {}
        self.failed = False
        self._q: torch.Tensor | None = None  # shared by every layer and bucket: [max_tokens, H * D]
        self._out: torch.Tensor | None = None
        self._hidden: torch.Tensor | None = None  # every bucket's last piece writes its hidden states here

    def _buffer(self, name: str, layer: Attention, t: int) -> torch.Tensor:
        width = layer.num_heads * layer.head_dim
        buf = getattr(self, name)
        if buf is None or buf.shape[1] != width:
            buf = torch.zeros(self.max_tokens, width, dtype=self.dtype, device=self.device)
            setattr(self, name, buf)
        return buf[:t]

    def q_buffer(self, layer: Attention, t: int) -> torch.Tensor:
        return self._buffer("_q", layer, t)

    def out_buffer(self, layer: Attention, t: int) -> torch.Tensor:
        return self._buffer("_out", layer, t)

    def _meta(self, t: int) -> AttentionMetadata:
        """What the captured forward sees: the static slots (padding stores nothing); attention never runs."""
        none = torch.zeros(1, dtype=torch.int32, device=self.device)
        empty = none[:0].view(0, 1)
        return AttentionMetadata(slot_mapping=self.slots[:t], num_decode_tokens=0,
                                 decode_block_tables=empty, decode_seq_lens=none[:0],
                                 prefill_cu_seqlens=none, prefill_seq_lens=none[:0],
                                 prefill_block_tables=empty,
                                 windows=tuple(WindowTables(w[:t], empty, empty) for w in self.window_slots))

    def capture(self, t: int) -> Pieces:
        """Capture the pieces of a t-token forward; the first capture (the largest bucket, capture_all's order)
        warms up first (compile, first uses, the static output), with attention skipped. Later buckets differ in
        shapes only: their new kernel variants compile inside the capture, as the decode graphs' PDL variants do,
        so no bucket after the first runs an eager forward of its own (40 buckets at an 8192-token budget)."""
        if t in self.pieces:
            return self.pieces[t]
        for slots in (self.slots, *self.window_slots):
            slots[:t].fill_(-1)
        meta = self._meta(t)
        if self._hidden is None:
            with attention_breaks(_Recorder(self, t, capture=False).attention):
                warm = self.model(self.ids[:t], self.positions[:t], meta)
            self._hidden = torch.empty(self.max_tokens, warm.shape[1], dtype=warm.dtype, device=self.device)
            del warm
        torch.cuda.synchronize(self.device)
        rec = _Recorder(self, t, capture=True)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream), attention_breaks(rec.attention):
            rec.begin()
            try:
                self._hidden[:t].copy_(self.model(self.ids[:t], self.positions[:t], meta))
            finally:  # a failed forward still ends the capture it is in, or the stream stays unusable
                rec.end()
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.pieces[t] = rec.pieces
        log.debug("captured %d forward pieces for %d tokens", len(rec.pieces.graphs), t)
        return rec.pieces

    def capture_all(self, on_captured: Callable[[], None] | None = None) -> int:
        """Capture every bucket (the runner's warm-up), so that no served step pays a capture, calling on_captured
        after each; returns the count."""
        for b in all_buckets(self.max_tokens):
            self.capture(b)
            if on_captured is not None:
                on_captured()
        return len(self.pieces)

    def captured(self, tokens: int) -> bool:
        """Whether a step of this many tokens replays pieces already captured (a capture is a forward of its own,
        whose cache hooks must find the host tier's copies waited for)."""
        b = bucket_for(tokens, self.max_tokens)
        return b is not None and b in self.pieces and not self.failed

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Hidden states [T, hidden] of an eager step, or None when its token count has no bucket."""
        t = int(input_ids.shape[0])
        b = bucket_for(t, self.max_tokens)
        if b is None or self.failed:
            return None
        if not self.cuda:
            return self._emulate(input_ids, positions, meta, b)
        try:
            pieces = self.pieces.get(b) or self.capture(b)
        except Exception:  # warm-up captured every bucket: a late capture failing costs speed, not the step
            log.exception("piecewise capture of %d tokens failed: eager steps run without pieces from now on", b)
            self.failed = True
            return None
        self._stage(input_ids, positions, meta, b)
        replay(pieces, lambda layer: layer.attend(self._q[:t], meta, out=self._out[:t]))  # type: ignore[index]
        assert self._hidden is not None
        return self._hidden[:t]

    def _stage(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, b: int) -> int:
        """The step's inputs into the static buffers, its pad rows [t, b) storing nothing; returns t."""
        t = int(input_ids.shape[0])
        self.ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        if len(meta.windows) != len(self.window_slots):
            raise ValueError(f"a step of {len(meta.windows)} sliding-window groups reached pieces built for "
                             f"{len(self.window_slots)}")
        for static, step in zip((self.slots, *self.window_slots), (meta, *meta.windows)):
            static[:t].copy_(step.slot_mapping)
            static[t:b].fill_(-1)
        return t

    def _emulate(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 b: int) -> torch.Tensor:
        """run() without graphs (CPU tests): the same padded static inputs, the same q and output buffers and the
        same eager attention over the real rows at each break, in one forward."""
        t = self._stage(input_ids, positions, meta, b)

        def attention(layer: Attention, q: torch.Tensor) -> torch.Tensor:
            self.q_buffer(layer, b).copy_(q.reshape(b, -1))
            attention_layer.set_piece_break(None)  # the eager call below must not come back here
            try:
                layer.attend(self.q_buffer(layer, t), meta, out=self.out_buffer(layer, t))
            finally:
                attention_layer.set_piece_break(attention)
            return self.out_buffer(layer, b)

        with attention_breaks(attention):
            return self.model(self.ids[:b], self.positions[:b], self._meta(b))[:t]


def replay(pieces: Pieces, attend: Callable[[Attention], object]) -> None:
    """Replay a bucket's pieces with its eager attention between them. Piece i stores layer i's K/V into its cache
    (the store is captured), so layer i's host-tier copies (executor/host_copy.py: its `kv_ready` hook) are waited
    for just before piece i, not all before the first: they land while the layers before it compute."""
    for graph, layer in zip(pieces.graphs, pieces.layers):
        if layer.kv_ready is not None:
            layer.kv_ready()
        graph.replay()
        attend(layer)
    pieces.graphs[-1].replay()


def piecewise_max_tokens(config: ApplianceConfig, model: torch.nn.Module, decode_graphs: bool, tp_size: int,
                         step_tokens: StepTokens) -> int | None:
    """The largest step run in pieces (backends.piecewise_cuda_graph_max_tokens, capped by the largest chunk the
    KV sizing's profile counted), or None when they are off or cannot apply here (logged)."""
    b = config.backends
    why = ("backends.piecewise_cuda_graph is off" if not b.piecewise_cuda_graph
           else "decode graphs are off (CPU, enforce_eager or the backend)" if not decode_graphs
           else f"{type(model).__name__} does not declare piecewise graph support" if not model_supports_pieces(model)
           else "tensor parallelism (one GPU only so far)" if tp_size != 1
           else "chunked prefill is off" if not step_tokens.chunking else None)
    if why is not None:
        if b.piecewise_cuda_graph and decode_graphs:
            log.info("mixed / prefill steps run eagerly: %s", why)
        return None
    return min(b.piecewise_cuda_graph_max_tokens or step_tokens.budget, step_tokens.largest_chunk)


def model_supports_pieces(model: torch.nn.Module) -> bool:
    """Models whose forward never syncs with the host and reaches attention only through Attention.attend (the
    class attribute `piecewise_graphs`: the Llama family and its MoE models, not MLA)."""
    return bool(getattr(model, "supports_cuda_graphs", False)) and bool(getattr(model, "piecewise_graphs", False))
