"""Verification steps as decode rows, replayed from CUDA graphs.

A step that verifies drafts schedules each request as 1 + d tokens (d drafts, d <= speculative.num_steps) and
plain decodes as one. Every query token becomes a decode row of its own: row j of a request's chunk has the
token at position start + j, sees the cache up to and including itself (seq_len = start + j + 1) and reads the
request's block table. The step stores every row's K/V before any layer attends, so row j sees the drafts before
it and nothing after: causal attention over the chunk with the decode kernel (split along the context, which
a batch of one needs), and a verification row computes exactly what a plain decode at that position would
(the same kernel, the same bucketed table width: executor/cuda_graph.py width_bucket).

Such a step has a fixed shape once its row count is padded (pad rows: token 0, table row 0, slot -1,
seq_len 0, as in the decode graphs), so it replays a graph captured per (padded rows, table-width bucket).
Row buckets are b * (num_steps + 1) for the decode graphs' capture sizes b up to the speculation's batch cap
(speculative.disable_by_batch_size, and MAX_VERIFY_BATCH: above it a step is compute-bound and runs eagerly,
and start-up captures no more graphs than it needs). The upload holds each row's token id, table row and
offset j within its chunk; inside the graph the `verify_positions` kernel places row j at lens[row] + j (lens
holds the chunk's start: a correction is sent only where the host's mirror differs) and writes its slot and
seq_len, then each request's length moves to its chunk's end (request_table.py `place_chunks`), which a
verification decided on the device (device_verification.py) sets back to the confirmed end, so a rollback
needs no correction in the next step. A step with a row count above every bucket, prompt logprobs or a prefill
chunk runs as before (ModelRunner._forward: prefill attention).
On a CPU the same class runs the same padded body without capturing (the torch reference kernels), so the
speculative parity tests exercise it. Hybrid models (a recurrent state per sequence, advanced once per decode
row) and the flashinfer backend (graphs not wired) keep the multi-token path.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from appliance.executor.cuda_graph import (
    GRAPH_CONTEXT,
    DecodeGraphs,
    GraphKey,
    graph_settings,
    padded_batch,
    width_bucket,
)
from appliance.executor.input_batch import Chunk, graph_stride, table_width
from appliance.executor.startup import STARTUP
from appliance.layers.attention import AttentionMetadata, longest_first

if TYPE_CHECKING:
    from appliance.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)

MAX_VERIFY_BATCH = 64  # requests per captured verification step; larger steps run eagerly


def verify_batches(runner: ModelRunner) -> list[int] | None:
    """Request batch sizes whose verification steps run as decode rows (captured on a GPU), or None where
    verification keeps the multi-token path."""
    c = runner.config
    if runner.state_cache is not None or runner.backend == "flashinfer":
        return None
    cap = min(MAX_VERIFY_BATCH, c.scheduler.max_num_seqs, c.speculative.disable_by_batch_size or MAX_VERIFY_BATCH)
    if runner.device.type == "cuda":
        sizes = graph_settings(c, runner.model, runner.device, runner.backend)
    else:  # uncaptured, the padded body on the reference kernels (module docstring)
        from appliance.executor.cuda_graph import capture_sizes

        sizes = capture_sizes(c.backends.cuda_graph_sizes, c.backends.cuda_graph_max_bs, c.scheduler.max_num_seqs)
    if sizes is None:
        return None
    return [b for b in sizes if b <= cap] or [min(sizes)]


def make_verify_graphs(runner: ModelRunner, num_steps: int) -> VerifyGraphs | None:
    """The runner's verification graphs (None: verification keeps the multi-token path), every key for
    GRAPH_CONTEXT tokens captured now on a GPU (a start-up phase) rather than on first use in a run."""
    batches = verify_batches(runner)
    if batches is None:
        return None
    rows = sorted({b * (num_steps + 1) for b in batches})
    # rows from which the target's decode attention is the same launch at every width (cuda_graph.py)
    unsplit = runner.graphs.unsplit_from if runner.graphs is not None else None
    graphs = VerifyGraphs(runner.model, int(runner.hf_config.hidden_size), runner.dtype, runner.device, rows,
                          runner.max_blocks, runner.block_size, runner.block_table, unsplit)
    graphs.fresh_rows = num_steps + 2  # a request's rows (a catch-up's too: one more) stored before attending
    if runner.graphs is not None:
        graphs.pool = runner.graphs.pool  # every graph's intermediates die at its end: one pool serves all
    if graphs.cuda:
        keys = graphs.keys_up_to(min(GRAPH_CONTEXT, runner.max_model_len))
        with STARTUP.phase("capturing verify graphs", len(keys)), torch.inference_mode():
            graphs.capture_all(min(GRAPH_CONTEXT, runner.max_model_len), STARTUP.advance)
            for m in rows:  # the LM head's GEMM at each row count a verification scores (cuBLAS's first use)
                runner.logits(graphs.hidden, list(range(m)))
        log.info("speculative decoding: %d verify graphs captured (rows %s, batches up to %d)", len(graphs.graphs),
                 rows, batches[-1])
    return graphs


def verify_rows(chunks: list[Chunk], block_size: int, batch: int, out64: np.ndarray, shift: int | None = 0) -> None:
    """Fill out64's first five segments of graph_stride(batch): [ids | table rows | positions | slots |
    seq_lens], one row per query token, padding after the real rows. shift: row j of a chunk reads the token
    at start + j + shift (1: a drafter fed the next token, catch_up_graphs.py); None: ids left 0 (written on
    the device)."""
    s = graph_stride(batch)
    v = out64[: 5 * s].reshape(5, s)
    v[:] = 0
    v[3] = -1  # pad rows store nothing
    i = 0
    for c in chunks:
        st, n = c.state, c.num_tokens
        pos = np.arange(c.start, c.start + n, dtype=np.int64)
        blocks = st.block_array()
        if (c.start + n - 1) // block_size >= blocks.shape[0]:
            raise RuntimeError(f"request {st.request_id!r}: {c.start + n} tokens exceed its {blocks.shape[0]} blocks")
        if shift is not None:
            v[0, i : i + n] = st.token_ids[c.start + shift : c.start + shift + n]
        v[1, i : i + n] = st.table_row
        v[2, i : i + n] = pos
        v[3, i : i + n] = blocks[pos // block_size] * block_size + pos % block_size
        v[4, i : i + n] = pos + 1
        i += n


def chunk_rows(chunks: list[Chunk], block_size: int, batch: int, out64: np.ndarray, with_ids: bool = True) -> None:
    """Fill out64's first three segments of graph_stride(batch): [ids | table rows | offsets], one row per query
    token (row j of a chunk: the token at start + j, offset j), padding after the real rows (token 0, row 0);
    with_ids False: ids left 0 (written on the device)."""
    s = graph_stride(batch)
    v = out64[: 3 * s].reshape(3, s)
    v[:] = 0
    i = 0
    for c in chunks:
        st, n = c.state, c.num_tokens
        if (c.start + n - 1) // block_size >= len(st.block_ids):
            raise RuntimeError(f"request {st.request_id!r}: {c.start + n} tokens exceed its {len(st.block_ids)} blocks")
        if with_ids:
            v[0, i : i + n] = st.token_ids[c.start : c.start + n]
        v[1, i : i + n] = st.table_row
        v[2, i : i + n] = np.arange(n)
        i += n


class VerifyGraphs(DecodeGraphs):
    """Verification steps as decode rows (module docstring); `sizes` are row buckets."""

    SEGMENTS = 3  # [ids | table rows | offsets]
    fresh_rows = 1  # the most rows of one request a step stores (AttentionMetadata.decode_fresh_rows)
    _ahead = False  # the step being filled is launched ahead (run_step)

    def fits(self, chunks: list[Chunk], max_tokens: int) -> bool:
        """Whether a step of these chunks runs here: every chunk samples after at most max_tokens tokens, none
        wants prompt logprobs, and some chunk verifies drafts (a decode-only step replays the decode graphs)."""
        return (any(c.num_tokens > 1 for c in chunks)
                and all(c.sample and c.num_tokens <= max_tokens and not c.wants_prompt_logprobs for c in chunks))

    def key_for(self, chunks: list[Chunk]) -> GraphKey | None:
        batch = padded_batch(self.sizes, sum(c.num_tokens for c in chunks))
        if batch is None:
            return None
        return GraphKey(batch, self.width_for(batch, width_bucket(table_width(chunks), self.max_blocks)))

    def _rows_upload(self, chunks: list[Chunk], key: GraphKey, host: np.ndarray) -> None:
        if sum(c.num_tokens for c in chunks) > key.batch or table_width(chunks) > key.width:
            raise ValueError(f"a verification step of {len(chunks)} chunks does not fit a graph of {key.batch} rows x "
                             f"{key.width} blocks")
        chunk_rows(chunks, self.block_size, key.batch, host, with_ids=not self._ahead)

    def _lens_corrections(self, chunks: list[Chunk]) -> np.ndarray:
        """Every request's device length must be its chunk's start (the rows are placed from it); the mirror
        is set to the chunk's end, where the graph leaves it. A step launched ahead sends none: the previous
        verdict set each length to the start, which the host learns when it reads that verdict."""
        if self._ahead:
            return np.zeros((2, 0), dtype=np.int64)
        flat: list[int] = []
        for c in chunks:
            s = c.state
            if s.pos_on_device != c.start:
                flat += (s.table_row, c.start)
            s.pos_on_device = c.start + c.num_tokens
        return np.array(flat, dtype=np.int64).reshape(-1, 2).T

    def _rows(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A graph's query rows as decode rows, placed from the device lengths (`place_chunks`, which moves
        them to the chunks' ends): ids, positions and the metadata."""
        assert self.table is not None
        b, s, top = key.batch, graph_stride(key.batch), self.seq_lens.shape[0]
        ids, rows, offsets = (self.buf[i * s : i * s + b] for i in range(3))
        positions, slots = self.computed[:b], self.computed[top : top + b]
        self.table.place_chunks(rows, offsets, self.block_size, positions, slots, self.seq_lens[:b])
        return ids, positions, self._meta(key, rows, slots)

    def _meta(self, key: GraphKey, rows: torch.Tensor, slots: torch.Tensor) -> AttentionMetadata:
        assert self.table is not None
        b, w = key.batch, key.width
        seq_lens = self.seq_lens[:b]
        return AttentionMetadata(
            slot_mapping=slots, num_decode_tokens=b, decode_block_tables=self.table.gather(rows, w),
            decode_seq_lens=seq_lens, prefill_cu_seqlens=self._no_prefill, prefill_seq_lens=self._no_prefill[:0],
            prefill_block_tables=self._no_prefill[:0].view(0, 1), decode_order=longest_first(seq_lens),
            decode_fresh_rows=self.fresh_rows)

    def _body(self, key: GraphKey) -> None:
        ids, positions, meta = self._rows(key)
        self.hidden[: key.batch].copy_(self.forward(ids, positions, meta))

    def run_step(self, chunks: list[Chunk], fix: Callable[[GraphKey], None] | None = None, ahead: bool = False
                 ) -> tuple[list[int], torch.Tensor] | None:
        """Each chunk's first row and the hidden states of a verification step, or None when no graph fits it.
        fix(key) may write the uploaded inputs (`buf`, laid out for the key) on the device before the replay.
        ahead: the chunks' starts are the device lengths already and their ids are written by `fix`
        (verify_ahead.py: launched before the previous step was read; the chunks' starts are provisional)."""
        key = self.key_for(chunks)
        if key is None:
            return None
        if key not in self.graphs:
            self.capture(key)
        self._ahead = ahead
        try:
            self._fill(chunks, key)
        finally:
            self._ahead = False
        if fix is not None:
            fix(key)
        self.graphs[key]()
        self.last_key = key
        starts = np.cumsum([0] + [c.num_tokens for c in chunks]).tolist()
        return starts[:-1], self.hidden[: starts[-1]]
