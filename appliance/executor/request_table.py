"""Per-request state that stays on the device between steps: block tables and computed lengths, kept by deltas.

Block tables. A plan appends block ids to a request's table a few at a time (a decode crosses into a new block
every block_size tokens), so instead of sending every row's whole table each step, the runner keeps one
persistent int32 tensor [capacity + 1, width] on the device and writes only the block ids it has not written
yet: their (flat index, block id) pairs travel in the step's one staged host array and one `index_copy_`
writes them. The kernels then read a table gathered on the device (`index_select` of the step's rows, narrowed
to the step's width), which equals the host-built table of before: a row holds its request's blocks, then zeros.

Lengths (positions). `lens` [capacity + 1] int64 holds, per row, the tokens of its request the device has
computed, i.e. the position of its next token. A one-token (decode) row sends only its table row: the
`decode_positions` kernel (kernels/triton/positions.py, torch reference on the CPU) reads lens, writes the
row's position, seq_len and cache slot (from the table) and advances lens by one, in one launch (inside the
captured graph on a GPU). The host mirrors lens per request (`RequestState.pos_on_device`) and sends a
(row, value) correction only where a chunk's start differs from the mirror: a new or re-added (preempted)
request, a prefix-cache hit, a speculative verification whose drafts were rejected (num_computed rolled back).
Multi-token (prefill) chunks keep host-built positions; their correction sets lens to the chunk's END before
the step (nothing in the step reads it), so after any step lens[row] = start + num_tokens of the row's last
chunk and the mirror says so. Decode rows in flight (overlap mode) need no correction: the next step's start
is the previous step's end, which is what the device holds by then (stream order).

Row 0 is reserved and never written (all zeros, lens 0): padding rows of a batch point at it and get position
0, seq_len 0, slot -1. A request gets a row when the worker first sees it (`LiveRequests.__setitem__`) and
gives it back when it is dropped (finished, aborted or preempted: the plan's finished_ids; `pop`, `del`,
`clear`). A reused row may still hold the previous owner's block ids past the new owner's table: its first
delta also writes zeros over them, so no request ever reads another's blocks; its length is unknown to the new
owner's mirror, so the first step always corrects it. Tables only grow while a request is live (a preempted
request comes back as a new state with a new row and its whole table).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.kernels import registry

if TYPE_CHECKING:
    from appliance.executor.input_batch import Chunk

UNKNOWN_POSITION = -1  # RequestState.pos_on_device of a row whose device length the host does not know


@dataclass
class RequestState:
    """What a worker remembers about a request between steps (mutable: it grows every step)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    num_computed: int
    block_ids: list[int]
    params: SamplingParams
    prompt_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    noise_seed: int = 0  # the GPU sampler's per-request stream for unseeded random rows
    # overlap mode: tokens sampled by steps still in flight (not in token_ids yet), and where the latest one is
    # on the device (that step's sampled-ids tensor, row): the next decode reads its input id from there
    num_pending: int = 0
    pending_at: tuple[torch.Tensor, int] | None = field(default=None, repr=False)
    # its row of the runner's device block table (0: none yet), how many of block_ids are written there, and
    # the row's computed length on the device as the host knows it (request_table.py; -1: unknown)
    table_row: int = 0
    blocks_on_device: int = 0
    pos_on_device: int = UNKNOWN_POSITION
    _blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)
    # its table in each sliding-window KV cache group (engine/kv_groups.py), as long as block_ids; none when the
    # model's layers share one group
    window_tables: list[list[int]] = field(default_factory=list)
    # per sliding group: how many of window_tables[g] the device's window tables hold (window_table.py; decode
    # graphs only), reset with the row like blocks_on_device
    windows_on_device: list[int] = field(default_factory=list)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_generated(self) -> int:
        """Tokens generated so far, the ones still in flight included."""
        return len(self.token_ids) + self.num_pending - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending

    def block_array(self) -> np.ndarray:
        """block_ids as numpy, re-converted only when the table grew (every block_size tokens)."""
        if self._blocks.shape[0] != len(self.block_ids):
            self._blocks = np.asarray(self.block_ids, dtype=np.int64)
        return self._blocks


ZERO_ROW = 0  # reserved: padding rows read it; a RequestState with table_row 0 has no row
COLUMN_MULTIPLE = 16  # padded prefill tables round their width up to 16 columns (input_batch.build_inputs)


def scatter_delta(table: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """One scatter of a table delta into `table` at flat positions (already on the device; values int32 or int64):
    the full table's and the sliding groups' (window_table.py)."""
    if index.numel():
        table.view(-1).index_copy_(0, index, values.to(torch.int32))


class DeviceBlockTable:
    """The persistent block tables and computed lengths of one worker's live requests (see the module
    docstring)."""

    def __init__(self, capacity: int, max_blocks: int, device: torch.device, kernels: str | None = None) -> None:
        """kernels: the `decode_positions` / `verify_positions` backend; None: triton on a CUDA device, else the
        torch reference."""
        if capacity < 1 or max_blocks < 1:
            raise ValueError(f"a block table needs capacity >= 1 and max_blocks >= 1, got {capacity}, {max_blocks}")
        self.capacity = capacity
        self.width = -(-max_blocks // COLUMN_MULTIPLE) * COLUMN_MULTIPLE
        self.table = torch.zeros(capacity + 1, self.width, dtype=torch.int32, device=device)
        self.lens = torch.zeros(capacity + 1, dtype=torch.int64, device=device)
        backend = kernels or ("triton" if device.type == "cuda" else "torch")
        self._positions_op = registry.get("decode_positions", backend)
        self._chunk_positions_op = registry.get("verify_positions", backend)
        self._free = list(range(capacity, ZERO_ROW, -1))  # pop() hands out the lowest row first
        self._dirty = [0] * (capacity + 1)  # per row: columns a previous owner may have left nonzero

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, state: RequestState) -> None:
        if state.table_row != ZERO_ROW:
            raise RuntimeError(f"request {state.request_id!r} already holds block-table row {state.table_row}")
        if not self._free:
            raise RuntimeError(f"request {state.request_id!r}: all {self.capacity} rows of the worker's block table "
                               "are taken (one per live request, sized by scheduler.max_num_seqs); the plan holds "
                               "more live requests than the scheduler may run at once")
        state.table_row = self._free.pop()
        state.blocks_on_device, state.pos_on_device = 0, UNKNOWN_POSITION  # the row's length is a stranger's
        state.windows_on_device = []

    def release(self, state: RequestState) -> None:
        if state.table_row == ZERO_ROW:
            return
        self._free.append(state.table_row)
        state.table_row, state.blocks_on_device, state.pos_on_device = ZERO_ROW, 0, UNKNOWN_POSITION
        state.windows_on_device = []

    def delta(self, states: Iterable[RequestState]) -> tuple[np.ndarray, np.ndarray]:
        """(flat index into table, block id), int64, of every entry the device lacks for these requests; marks
        them written, so the caller must apply them (`apply`) before the step's gather."""
        index: list[np.ndarray] = []
        values: list[np.ndarray] = []
        w = self.width
        for s in states:
            n, have = len(s.block_ids), s.blocks_on_device
            if n == have:
                continue
            row = s.table_row
            if row == ZERO_ROW:
                raise RuntimeError(f"request {s.request_id!r} has no block-table row (not added through the "
                                   "runner's live requests)")
            if n < have:
                raise RuntimeError(f"request {s.request_id!r}: its block table shrank from {have} to {n} blocks; "
                                   "tables only grow while a request is live")
            if n > w:
                raise ValueError(f"request {s.request_id!r}: {n} blocks exceed the block table's {w} columns "
                                 "(max_model_len / block_size)")
            end = n
            blocks = np.asarray(s.block_ids[have:n], dtype=np.int64)  # the new ids only: O(delta)
            if have == 0 and self._dirty[row] > n:  # a reused row: clear what its previous owner left
                end = self._dirty[row]
                blocks = np.concatenate([blocks, np.zeros(end - n, np.int64)])
            index.append(np.arange(row * w + have, row * w + end, dtype=np.int64))
            values.append(blocks)
            self._dirty[row] = max(self._dirty[row], n)
            s.blocks_on_device = n
        if not index:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(index), np.concatenate(values)

    def apply(self, index: torch.Tensor, values: torch.Tensor) -> None:
        scatter_delta(self.table, index, values)

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """[len(rows), width] int32 tables of these rows (ZERO_ROW for padding), contiguous."""
        if width > self.width:
            raise ValueError(f"a block table of width {width} exceeds the persistent table's {self.width} columns")
        return self.table[:, :width].index_select(0, rows)

    def lens_delta(self, chunks: Iterable[Chunk]) -> np.ndarray:
        """[2, m] int64 (table row, length) corrections that make `lens` ready for these chunks, and the mirrors
        set to what the device holds after the step (every chunk's end). A one-token chunk needs lens = its start
        (the kernel advances it); a longer one gets its end at once (its positions are host-built). The caller
        must apply them (`set_lens`) before the step's `advance`."""
        flat: list[int] = []
        for c in chunks:
            s, end = c.state, c.start + c.num_tokens
            want = c.start if c.num_tokens == 1 else end
            if s.pos_on_device != want:
                if s.table_row == ZERO_ROW:
                    raise RuntimeError(f"request {s.request_id!r} has no block-table row (not added through the "
                                       "runner's live requests)")
                flat += (s.table_row, want)
            s.pos_on_device = end
        return np.array(flat, dtype=np.int64).reshape(-1, 2).T

    def set_lens(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """One scatter of length corrections (already on the device, int64)."""
        if rows.numel():
            self.lens.index_copy_(0, rows, values)

    def advance(self, rows: torch.Tensor, block_size: int, positions: torch.Tensor, slots: torch.Tensor,
                seq_lens: torch.Tensor) -> None:
        """Inputs of one-token rows (pad rows: ZERO_ROW) from the device state, in one launch: positions and
        slots [B] int64, seq_lens [B] int32 are written; each real row's length advances by one."""
        self._positions_op(rows, self.table, self.lens, block_size, positions, slots, seq_lens)

    def place_chunks(self, rows: torch.Tensor, offsets: torch.Tensor, block_size: int, positions: torch.Tensor,
                     slots: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """Inputs of multi-token chunks run as decode rows (verify_graphs.py): row i at lens[rows[i]] +
        offsets[i] (lens holds each chunk's start), then each real row's length moved to its chunk's end (the
        largest position + 1: one deterministic scatter, whatever the rows' order; padding rows add 0 to row 0)."""
        self._chunk_positions_op(rows, offsets, self.table, self.lens, block_size, positions, slots, seq_lens)
        self.lens.scatter_reduce_(0, rows.long(), seq_lens.long(), reduce="amax")


class LiveRequests(MutableMapping[str, RequestState]):
    """The runner's live requests by id: adding one gives it a table row, dropping one (pop, del, clear)
    frees the row. Everything that adds or drops requests (ModelRunner, speculative.Speculator,
    InProcessExecutor.shutdown) goes through this mapping, so rows never leak."""

    def __init__(self, table: DeviceBlockTable) -> None:
        self.table = table
        self._states: dict[str, RequestState] = {}

    def __getitem__(self, request_id: str) -> RequestState:
        return self._states[request_id]

    def get(self, request_id: str, default: RequestState | None = None) -> RequestState | None:  # type: ignore[override]
        return self._states.get(request_id, default)  # hot path: skips MutableMapping's try/except

    def __setitem__(self, request_id: str, state: RequestState) -> None:
        if state.request_id != request_id:
            raise ValueError(f"state of request {state.request_id!r} added under id {request_id!r}")
        old = self._states.get(request_id)
        if old is state:
            return
        self.table.acquire(state)  # first: a full table leaves the old state in place
        if old is not None:
            self.table.release(old)
        self._states[request_id] = state

    def __delitem__(self, request_id: str) -> None:
        self.table.release(self._states.pop(request_id))

    def __iter__(self) -> Iterator[str]:
        return iter(self._states)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._states
