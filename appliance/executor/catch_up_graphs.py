"""The drafter's catch-up after a verification step, as decode rows replayed from CUDA graphs.

After a step verified drafts, the drafter runs over each request's newly confirmed positions (its own KV cache then
holds them) and its last row drafts the first token of the next chain (speculative.py step 3). For a step the verify
graphs ran (verify_graphs.py: every chunk samples after at most num_steps + 1 tokens), those rows are at most the
step's rows, so the catch-up runs as decode rows too, each row seeing the drafter's cache up to itself: row j of a
request sits at position start + j and reads the token at start + j + shift (1 for EAGLE, EAGLE-3 and MTP, fed the
next token beside the target's state at j; 0 for a draft model, whose rows include the token just sampled) and, for
drafters fed the target's states, the target's row `take` of a static source (the verify graphs' output, or the
EAGLE-3 capture buffer), gathered inside the graph. The forward is the drafter's `draft_step` (a chain step is a
catch-up row of one token), so every row's argmax draft and hidden state land in static outputs (a step where some
request draws its drafts from the drafter's q keeps the eager catch-up); the speculator gathers each drafting
request's last row for the chain (draft_graphs.py) without a host round trip. Graphs are keyed by (padded rows,
table width) like the verify graphs and captured at start-up on a GPU; on a CPU the same body runs uncaptured. The
drafter keeps no `lens`: nothing is corrected. A row at or past its request's confirmed length (the target's device
length, plus one for a draft model, whose rows include the token just sampled) stores nothing and reads nothing:
after a step whose verifications were all decided on the device (device_proposal.py) the catch-up runs over the
whole chunks before the host knows what they kept, its ids the verdict's tokens written on the device (`fed`), and
the rows past the kept ones drop out here; rows the host built from the kept counts are all below that length.
"""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

import numpy as np
import torch

from appliance.executor.cuda_graph import GRAPH_CONTEXT, GraphKey
from appliance.executor.input_batch import Chunk, graph_stride, table_width
from appliance.executor.verify_graphs import VerifyGraphs, verify_rows
from appliance.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from appliance.executor.speculative import Speculator

log = logging.getLogger(__name__)


class CatchUpGraphs(VerifyGraphs):
    """Catch-up steps of one speculator's drafter (module docstring). `source`: the static tensor whose rows
    the drafter is fed (None: token ids only); `hidden_size`: the drafter's chained state (None: none)."""

    SEGMENTS = 6  # [ids | table rows | positions | slots | seq_lens | source rows]

    def __init__(self, spec: Speculator, source: torch.Tensor | None, hidden_size: int | None, shift: int,
                 verify: VerifyGraphs) -> None:
        super().__init__(lambda *_: None, hidden_size or 1, verify.hidden.dtype, verify.device, verify.sizes,
                         verify.max_blocks, verify.block_size, verify.table)
        self._step = weakref.WeakMethod(spec.draft_step)  # the speculator holds this object: no cycle
        assert spec.chains is not None
        self._greedy = spec.chains.greedy  # argmax drafts as target ids
        self.source, self.shift, self.chains_state = source, shift, hidden_size is not None
        self.pool, self.fresh_rows = verify.pool, verify.fresh_rows
        self.tokens = torch.zeros(verify.sizes[-1], dtype=torch.int64, device=verify.device)
        self._take: list[int] = []  # the step's source rows, set by run_step for _rows_upload
        self._fed = False  # the step's ids are written on the device (run_catch_up's `fed`)

    def _rows_upload(self, chunks: list[Chunk], key: GraphKey, host: np.ndarray) -> None:
        rows = sum(c.num_tokens for c in chunks)
        if rows > key.batch or table_width(chunks) > key.width or len(self._take) not in (0, rows):
            raise ValueError(f"a catch-up of {rows} rows does not fit a graph of {key.batch} x {key.width}")
        verify_rows(chunks, self.block_size, key.batch, host, None if self._fed else self.shift)
        s = graph_stride(key.batch)
        host[5 * s : 6 * s] = 0
        host[5 * s : 5 * s + len(self._take)] = self._take

    def _lens_corrections(self, chunks: list[Chunk]) -> np.ndarray:
        return np.zeros((2, 0), dtype=np.int64)  # the drafter reads no device lengths

    def _rows(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Host-built positions (the device lengths are the target's), rows past the confirmed length masked."""
        assert self.table is not None
        b, s = key.batch, graph_stride(key.batch)
        ids, rows, positions, slots = (self.buf[i * s : i * s + b] for i in range(4))
        seq_lens = self.seq_lens[:b]
        seq_lens.copy_(self.buf[4 * s : 4 * s + b])
        past = positions >= self.table.lens.index_select(0, rows) + (1 - self.shift)
        slots.masked_fill_(past, -1)
        seq_lens.masked_fill_(past, 0)
        return ids, positions, self._meta(key, rows, slots)

    def _body(self, key: GraphKey) -> None:
        step = self._step()
        assert step is not None
        b, s = key.batch, graph_stride(key.batch)
        ids, positions, meta = self._rows(key)
        fed = self.source.index_select(0, self.buf[5 * s : 5 * s + b]) if self.source is not None else None
        logits, hidden = step(ids, positions, meta, fed)
        self.tokens[:b].copy_(self._greedy(logits))
        if self.chains_state:
            self.hidden[:b].copy_(hidden)

    def run_catch_up(self, chunks: list[Chunk], take: list[int], fed: torch.Tensor | None = None,
                     placed: tuple[torch.Tensor, torch.Tensor] | None = None
                     ) -> tuple[list[int], torch.Tensor, torch.Tensor | None] | None:
        """Each chunk's first row, every row's draft and chained state, or None when no graph fits. `fed`: the
        rows' input ids on the device (else the host's token at start + j + shift). `placed`: the rows'
        positions and slots on the device (else built on the host from the chunks' starts)."""
        rows = sum(c.num_tokens for c in chunks)

        def fix(key: GraphKey) -> None:
            s = graph_stride(key.batch)
            if fed is not None:
                self.buf[:rows].copy_(fed)
            if placed is not None:
                self.buf[2 * s : 2 * s + rows].copy_(placed[0])
                self.buf[3 * s : 3 * s + rows].copy_(placed[1])
                torch.add(placed[0], 1, out=self.buf[4 * s : 4 * s + rows])

        self._take, self._fed = take, fed is not None
        got = self.run_step(chunks, fix if fed is not None or placed is not None else None)
        self._take, self._fed = [], False
        if got is None:
            return None
        starts, _ = got
        return starts, self.tokens[:rows], self.hidden[:rows] if self.chains_state else None


def make_catch_up_graphs(spec: Speculator, source: torch.Tensor | None, hidden_size: int | None,
                         shift: int) -> CatchUpGraphs | None:
    """The speculator's catch-up graphs beside its verify graphs (None without them), captured now on a GPU
    when its chains are (the drafter's forward can be captured)."""
    from appliance.executor.startup import STARTUP

    verify, chains = spec.verify_graphs, spec.chains
    if verify is None or chains is None:
        return None
    graphs = CatchUpGraphs(spec, source, hidden_size, shift, verify)
    if graphs.cuda and chains.captured:
        context = min(GRAPH_CONTEXT, spec.runner.max_model_len)
        keys = graphs.keys_up_to(context)
        with STARTUP.phase("capturing catch-up graphs", len(keys)), torch.inference_mode():
            graphs.capture_all(context, STARTUP.advance)
        log.info("speculative decoding: %d drafter catch-up graphs captured", len(graphs.graphs))
    elif graphs.cuda:
        return None  # a drafter that cannot be captured keeps its eager catch-up
    return graphs
