"""Worker-side request state and the flat varlen inputs of one step.

Rows of one step: every one-token request first (decode attention), then the multi-token chunks (prefill
attention over the paged cache, including any cached prefix). Token t of a request lives in cache slot
block_ids[t // block_size] * block_size + t % block_size.

Host cost matters here (it is paid every step, before the GPU can start): inputs are built with numpy into
one int64 array, staged in pinned memory and sent with a single non-blocking copy; the int32 fields (sequence
lengths, block tables) are cast on the device in one launch. `build_decode_arrays` fills the fixed-shape,
padded layout that a captured CUDA graph reads (executor/cuda_graph.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.layers.attention import AttentionMetadata


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
    _blocks: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64), repr=False)

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

    def token_at(self, position: int) -> int:
        """The input id at `position`; 0 for a token still in flight (the runner writes it on the device)."""
        return self.token_ids[position] if position < len(self.token_ids) else 0

    def block_array(self) -> np.ndarray:
        """block_ids as numpy, re-converted only when the table grew (every block_size tokens)."""
        if self._blocks.shape[0] != len(self.block_ids):
            self._blocks = np.asarray(self.block_ids, dtype=np.int64)
        return self._blocks


@dataclass(frozen=True)
class Chunk:
    """One request's share of a step: tokens [start, start + num_tokens) and whether to sample after it."""

    state: RequestState
    start: int
    num_tokens: int
    sample: bool

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.state.params.prompt_logprobs is not None and self.start < self.state.num_prompt_tokens


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    chunks: list[Chunk]  # in row order
    row_starts: list[int]  # first row of each chunk


def order_chunks(chunks: list[Chunk]) -> tuple[list[Chunk], list[Chunk]]:
    return [c for c in chunks if c.num_tokens == 1], [c for c in chunks if c.num_tokens > 1]


def _check_blocks(c: Chunk, block_size: int) -> None:
    end = c.start + c.num_tokens
    need = (end + block_size - 1) // block_size
    if len(c.state.block_ids) < need:
        raise RuntimeError(f"request {c.state.request_id!r}: {end} tokens need {need} blocks, its table has "
                           f"{len(c.state.block_ids)}")


def table_width(chunks: list[Chunk], minimum: int = 1) -> int:
    return max([minimum] + [len(c.state.block_ids) for c in chunks])


def fill_block_table(out: np.ndarray, chunks: list[Chunk]) -> None:
    """Rows of `out` ([>= len(chunks), W]) get each chunk's table; the rest of a row is left as it was."""
    for i, c in enumerate(chunks):
        blocks = c.state.block_array()
        out[i, : blocks.shape[0]] = blocks


def decode_rows(decodes: list[Chunk], block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token ids, positions, slots) of one-token rows, vectorised over the batch."""
    for c in decodes:
        _check_blocks(c, block_size)
    pos = np.fromiter((c.start for c in decodes), np.int64, len(decodes))
    ids = np.fromiter((c.state.token_at(c.start) for c in decodes), np.int64, len(decodes))
    blk = np.fromiter((c.state.block_ids[c.start // block_size] for c in decodes), np.int64, len(decodes))
    return ids, pos, blk * block_size + pos % block_size


def build_decode_arrays(decodes: list[Chunk], block_size: int, batch: int, width: int,
                        out64: np.ndarray, out32: np.ndarray) -> None:
    """Fill a CUDA graph's padded layout: out64 = [ids | positions | slots] (3 x batch), out32 = [seq_lens |
    block table] (batch + batch x width). Pad rows: token 0 at position 0, slot -1 (not stored), seq_len 0
    (the decode kernel writes zeros and reads no block)."""
    n = len(decodes)
    if n > batch or table_width(decodes) > width:
        raise ValueError(f"{n} decode rows / width {table_width(decodes)} do not fit a graph of {batch} x {width}")
    ids, pos, slots = decode_rows(decodes, block_size)
    v64 = out64[: 3 * batch].reshape(3, batch)
    v64[0, :n], v64[1, :n], v64[2, :n] = ids, pos, slots
    v64[0:2, n:] = 0
    v64[2, n:] = -1
    lens = out32[:batch]
    lens[:n] = pos + 1
    lens[n:] = 0
    fill_block_table(out32[batch : batch + batch * width].reshape(batch, width), decodes)


_ALIGN = 4  # elements: 16 bytes of int32 (and 32 of int64)


def padded_count(n: int) -> int:
    """Prefill sequences are padded to a power of two (empty sequences): the Triton prefill kernel compiles one
    variant per bit length of the count, so the variants are few and all met by the runner's warm-up."""
    return 1 << (n - 1).bit_length() if n > 1 else n


def build_inputs(chunks: list[Chunk], block_size: int, device: torch.device, decode_width: int = 1,
                 stager: Stager | None = None, pad_prefills: bool = False) -> StepInputs:
    """Order chunks decode-first and flatten them into one batch of rows.

    decode_width: least width of the decode block table (the split-K factor of decode attention follows the
    table's width, so the runner pads eager tables like its graphs to keep both numerically identical).
    stager: the runner's pinned staging buffer (default: a plain copy).
    pad_prefills: pad the prefill sequence count to a power of two with empty sequences (cu_seqlens repeated,
    seq_len 0) and the prefill table width to a multiple of 16, so kernel specialisations recur (GPU runner).
    """
    decodes, prefills = order_chunks(chunks)
    ordered = decodes + prefills
    nd, npf = len(decodes), len(prefills)
    npad = padded_count(npf) - npf if pad_prefills else 0
    ids_d, pos_d, slots_d = decode_rows(decodes, block_size)
    ids_l, pos_l, slots_l = [ids_d], [pos_d], [slots_d]
    row_starts = list(range(nd))
    cu = [0]
    for c in prefills:
        _check_blocks(c, block_size)
        end = c.start + c.num_tokens
        row_starts.append(nd + cu[-1])
        cu.append(cu[-1] + c.num_tokens)
        pos = np.arange(c.start, end, dtype=np.int64)
        ids_l.append(np.asarray(c.state.token_ids[c.start : end], dtype=np.int64))
        pos_l.append(pos)
        slots_l.append(c.state.block_array()[pos // block_size] * block_size + pos % block_size)
    t = nd + cu[-1]
    wd = table_width(decodes, decode_width) if nd else 1
    wp = -(-table_width(prefills) // 16) * 16 if pad_prefills else table_width(prefills)
    cu += [cu[-1]] * npad
    npf += npad
    # int64 head: ids, positions, slots; int32 tail (cast on the device): seq lens, cu, tables. Every segment
    # starts on a 16-byte boundary: Triton specialises pointer arguments on 16-byte alignment, so unaligned
    # views would compile new kernel variants in the middle of a run, depending on the batch's row counts.
    lens = [t, t, t, nd, npf + 1, npf, nd * wd, npf * wp]
    offs = np.concatenate([[0], np.cumsum([_ALIGN * -(-n // _ALIGN) for n in lens])])
    seg = [slice(int(offs[i]), int(offs[i]) + n) for i, n in enumerate(lens)]
    flat = np.zeros(int(offs[-1]), dtype=np.int64)
    flat[seg[0]] = np.concatenate(ids_l)
    flat[seg[1]] = np.concatenate(pos_l)
    flat[seg[2]] = np.concatenate(slots_l)
    flat[seg[3]] = pos_d + 1
    flat[seg[4]] = cu
    flat[seg[5]] = [c.start + c.num_tokens for c in prefills] + [0] * npad
    fill_block_table(flat[seg[6]].reshape(nd, wd), decodes)
    fill_block_table(flat[seg[7]].reshape(npf, wp), prefills)
    split = int(offs[3])
    if device.type == "cuda":  # one copy, then one cast launch for the int32 tail
        dev = (stager or Stager(device)).send(flat)
        head, tail = dev[:split], dev[split:].to(torch.int32)
    else:
        head = torch.from_numpy(flat[:split]).to(device)
        tail = torch.from_numpy(flat[split:].astype(np.int32)).to(device)
    o = [slice(x.start - split, x.stop - split) for x in seg[3:]]
    meta = AttentionMetadata(
        slot_mapping=head[seg[2]],
        num_decode_tokens=nd,
        decode_block_tables=tail[o[3]].view(nd, wd),
        decode_seq_lens=tail[o[0]],
        prefill_cu_seqlens=tail[o[1]],
        prefill_seq_lens=tail[o[2]],
        prefill_block_tables=tail[o[4]].view(npf, wp),
    )
    return StepInputs(head[seg[0]], head[seg[1]], meta, ordered, row_starts)


class Stager:
    """Host -> device copies through a reused pinned buffer: one non-blocking copy per call. Before the buffer
    is overwritten, the event of the previous copy is awaited (normally long done: steps read results back)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buf: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def send(self, flat: np.ndarray) -> torch.Tensor:
        src = torch.from_numpy(flat)
        if self.device.type != "cuda":
            return src.to(self.device)
        if self._event is not None:
            self._event.synchronize()
        if self._buf is None or self._buf.numel() < flat.size or self._buf.dtype != src.dtype:
            self._buf = torch.empty(max(flat.size, 1 << 16), dtype=src.dtype).pin_memory()
        staged = self._buf[: flat.size].view(src.shape)
        staged.copy_(src)
        out = staged.to(self.device, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()
        return out
