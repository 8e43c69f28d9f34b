"""CUDA graphs for decode-only steps: capture sizes, padding, and the captured forwards.

A step whose rows are all one-token decodes (no prompt logprobs) replays a graph captured for the smallest
capture size >= its batch; the extra rows are padding (token 0, slot -1 so nothing is stored, seq_len 0 so
decode attention reads nothing and writes zeros). Graphs are keyed by (batch size, block-table width): the
Triton decode kernel picks its split-K factor from the table's width, never from seq_lens (no host sync), so
the width is bucketed to a power of two of blocks, which keeps the split factor near what the real context
needs instead of what max_model_len allows. Graphs are captured lazily on first use (or all at once by
`capture_all`) into one shared memory pool; every graph reads the same static input buffers and writes its
hidden states into one static output, so only the final hidden states stay allocated.
On a CPU (tests) the same class runs the forward over the same padded static buffers without capturing, so
the padding and bucketing logic is exercised against the torch reference kernels.

The model's forward inside a graph must not synchronise with the host nor allocate outside the pool: models
declare this with a class attribute `supports_cuda_graphs = True` (the Llama family does).
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from appliance.executor.input_batch import Chunk, build_decode_arrays, table_width
from appliance.layers.attention import AttentionMetadata

log = logging.getLogger(__name__)

DEFAULT_MAX_BS = 256
MIN_WIDTH_BLOCKS = 16  # narrowest block table a graph is captured for

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
    """Captured decode forwards over static inputs; `run` fills the inputs, replays, returns hidden states."""

    def __init__(self, forward: Forward, hidden_size: int, dtype: torch.dtype, device: torch.device,
                 sizes: list[int], max_blocks: int, block_size: int) -> None:
        self.forward, self.device, self.sizes = forward, device, sizes
        self.max_blocks, self.block_size = max_blocks, block_size
        top = sizes[-1]
        self.cuda = device.type == "cuda"
        self.buf64 = torch.zeros(3 * top, dtype=torch.int64, device=device)
        self.buf32 = torch.zeros(top + top * max_blocks, dtype=torch.int32, device=device)
        self.host64 = torch.zeros(3 * top, dtype=torch.int64, pin_memory=self.cuda)
        self.host32 = torch.zeros(top + top * max_blocks, dtype=torch.int32, pin_memory=self.cuda)
        self.hidden = torch.zeros(top, hidden_size, dtype=dtype, device=device)
        self._no_prefill = torch.zeros(1, dtype=torch.int32, device=device)
        self.graphs: dict[GraphKey, Callable[[], None]] = {}  # replay functions
        self.pool = torch.cuda.graph_pool_handle() if self.cuda else None
        self._copied: torch.cuda.Event | None = None
        self.last_key: GraphKey | None = None

    def key_for(self, decodes: list[Chunk]) -> GraphKey | None:
        batch = padded_batch(self.sizes, len(decodes))
        if batch is None:
            return None
        return GraphKey(batch, width_bucket(table_width(decodes), self.max_blocks))

    def _views(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        b, w = key.batch, key.width
        meta = AttentionMetadata(
            slot_mapping=self.buf64[2 * b : 3 * b], num_decode_tokens=b,
            decode_block_tables=self.buf32[b : b + b * w].view(b, w), decode_seq_lens=self.buf32[:b],
            prefill_cu_seqlens=self._no_prefill, prefill_seq_lens=self._no_prefill[:0],
            prefill_block_tables=self._no_prefill[:0].view(0, 1))
        return self.buf64[:b], self.buf64[b : 2 * b], meta

    def _upload(self, key: GraphKey) -> None:
        n64, n32 = 3 * key.batch, key.batch + key.batch * key.width
        self.buf64[:n64].copy_(self.host64[:n64], non_blocking=self.cuda)
        self.buf32[:n32].copy_(self.host32[:n32], non_blocking=self.cuda)
        if self.cuda:
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _fill(self, decodes: list[Chunk], key: GraphKey) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers are about to be overwritten
        build_decode_arrays(decodes, self.block_size, key.batch, key.width, self.host64.numpy(),
                            self.host32.numpy())
        self._upload(key)

    def capture(self, key: GraphKey) -> None:
        if key in self.graphs:
            return
        ids, pos, meta = self._views(key)
        if not self.cuda:
            self.graphs[key] = lambda: self.hidden[: key.batch].copy_(self.forward(ids, pos, meta))
            return
        self._fill([], key)  # all padding: the warm-up and the capture store nothing in the KV cache
        self.forward(ids, pos, meta)  # compiles kernels and settles the allocator outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.hidden[: key.batch].copy_(self.forward(ids, pos, meta))
        self.graphs[key] = graph.replay
        log.debug("captured decode graph batch=%d width=%d", key.batch, key.width)

    def capture_all(self, max_context: int) -> int:
        """Capture every size for every width bucket up to max_context tokens, largest first (pool reuse)."""
        widths = sorted({width_bucket(min(b, self.max_blocks), self.max_blocks)
                         for b in _powers(MIN_WIDTH_BLOCKS, -(-max_context // self.block_size))}, reverse=True)
        for w in widths:
            for b in reversed(self.sizes):
                self.capture(GraphKey(b, w))
        return len(self.graphs)

    def run(self, decodes: list[Chunk], key: GraphKey,
            fix_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """Hidden states [len(decodes), hidden] of a decode-only step (a view of the static output).
        fix_ids(ids) may rewrite the uploaded input ids on the device before the replay (tokens in flight)."""
        if key not in self.graphs:
            self.capture(key)
        self._fill(decodes, key)
        if fix_ids is not None:
            fix_ids(self.buf64[: len(decodes)])
        self.graphs[key]()
        self.last_key = key  # benchmarks replay it to time the GPU side alone
        return self.hidden[: len(decodes)]


def _powers(start: int, stop: int) -> list[int]:
    out = [start]
    while out[-1] < stop:
        out.append(out[-1] * 2)
    return out


def graph_settings(config: object, model: torch.nn.Module, device: torch.device) -> list[int] | None:
    """Capture sizes, or None when graphs are off (CPU, enforce_eager, or a model that does not support them)."""
    b = config.backends  # type: ignore[attr-defined]
    if device.type != "cuda" or b.enforce_eager:
        return None
    if not getattr(model, "supports_cuda_graphs", False):
        log.info("%s does not declare CUDA graph support: decode runs eagerly", type(model).__name__)
        return None
    from appliance.layers.parallel_state import get_ep_size

    if get_ep_size() > 1:  # expert dispatch under capture is not verified yet
        log.info("expert parallelism: decode runs eagerly (CUDA graphs are off with ep > 1)")
        return None
    # Tensor parallelism: the all-reduces (one-shot over CUDA IPC buffers, or NCCL) are captured into the graphs.
    # Every rank must replay the same graph each step, or the collectives inside would pair up wrongly and hang:
    # they do, because every rank receives the same StepPlan and the graph key (padded batch, table-width
    # bucket) is a function of the plan alone; capture_all captures the same keys in the same order everywhere.
    return capture_sizes(b.cuda_graph_sizes, b.cuda_graph_max_bs,
                         config.scheduler.max_num_seqs)  # type: ignore[attr-defined]
