"""The flat varlen inputs of one step (the worker-side request state: request_table.py RequestState).

Rows of one step: every one-token request first (decode attention), then the multi-token chunks (prefill
attention over the paged cache, including any cached prefix). Token t of a request lives in cache slot
block_ids[t // block_size] * block_size + t % block_size.

Host cost matters here (it is paid every step, before the GPU can start): inputs are built with numpy into
one int64 array, staged in pinned memory and sent with a single non-blocking copy; the int32 fields (sequence
lengths, new block ids, prefill table rows) are cast on the device in one launch. With the runner's persistent
device state (executor/request_table.py) a row sends its table row index and only the deltas the device lacks
(new block ids, length corrections); its block table is gathered on the device, and a one-token row's position,
seq_len and slot are computed there (`DeviceBlockTable.advance`): the host sends [token id | table row] per
decode row (`decode_ids`). Multi-token chunks keep host-built positions. Without device state (warm-up,
profiling, the drafter's catch-up) positions and tables are built here (`decode_rows`). `build_graph_rows`
fills the fixed-shape, padded upload that a captured CUDA graph reads (executor/cuda_graph.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from appliance.executor.window_inputs import window_tables
from appliance.layers.attention import AttentionMetadata, SequenceStates, TreeMask, longest_first

if TYPE_CHECKING:
    from appliance.executor.draft_tree import DraftTree
    from appliance.executor.request_table import DeviceBlockTable, RequestState
    from appliance.executor.window_table import WindowDeviceTables


@dataclass(frozen=True)
class Chunk:
    """One request's share of a step: tokens [start, start + num_tokens) and whether to sample after it. A
    verification of a draft tree (`tree`: its root and nodes are the chunk's tokens) runs its rows at their depths
    under the tree's mask, each still in its own slot (draft_tree.py)."""

    state: RequestState
    start: int
    num_tokens: int
    sample: bool
    tree: DraftTree | None = None

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


def decode_rows(decodes: list[Chunk], block_size: int) -> np.ndarray:
    """[4, n] int64 of one-token rows built on the host: token ids, positions, slots, device table rows (the
    path without device tables, and the oracle of the device-computed ones)."""
    flat: list[int] = []
    for c in decodes:
        s, p = c.state, c.start
        blocks, tokens = s.block_ids, s.token_ids
        if p // block_size >= len(blocks):
            _check_blocks(c, block_size)  # raises, with the message
        flat += (tokens[p] if p < len(tokens) else 0,  # 0: a token in flight (the runner writes it on the device)
                 p, blocks[p // block_size] * block_size + p % block_size, s.table_row)
    return np.array(flat, dtype=np.int64).reshape(len(decodes), 4).T


def decode_ids(decodes: list[Chunk], block_size: int) -> np.ndarray:
    """[2, n] int64 of one-token rows whose positions, slots and seq_lens the device computes (request_table.py):
    token ids and device table rows. One pass over the rows (this loop is most of a decode step's host cost)."""
    flat: list[int] = []
    for c in decodes:
        s, p = c.state, c.start
        if p >= len(s.block_ids) * block_size:
            _check_blocks(c, block_size)  # raises, with the message
        tokens = s.token_ids
        flat += (tokens[p] if p < len(tokens) else 0, s.table_row)  # 0: in flight (the runner writes it)
    return np.array(flat, dtype=np.int64).reshape(len(decodes), 2).T


_ALIGN = 4  # elements: 16 bytes of int32 (and 32 of int64)


def graph_stride(batch: int) -> int:
    """Elements per segment of a graph's static int64 inputs (every segment starts 32-byte aligned)."""
    return _ALIGN * -(-batch // _ALIGN)


def build_graph_rows(decodes: list[Chunk], block_size: int, batch: int, width: int, out64: np.ndarray) -> None:
    """Fill a CUDA graph's padded upload: out64 = [ids | table rows], two segments of graph_stride(batch). Pad
    rows: token 0, table row 0 (the device table's all-zero row, which `DeviceBlockTable.advance` gives position
    0, seq_len 0 and slot -1: nothing is stored, decode attention reads no block and writes zeros)."""
    n = len(decodes)
    if n > batch or table_width(decodes) > width:
        raise ValueError(f"{n} decode rows / width {table_width(decodes)} do not fit a graph of {batch} x {width}")
    stride = graph_stride(batch)
    v = out64[: 2 * stride].reshape(2, stride)
    v[:, :n] = decode_ids(decodes, block_size)
    v[:, n:] = 0


def padded_count(n: int) -> int:
    """Prefill sequences are padded to a power of two (empty sequences): the Triton prefill kernel compiles one
    variant per bit length of the count, so the variants are few and all met by the runner's warm-up."""
    return 1 << (n - 1).bit_length() if n > 1 else n


def _layout(sizes: list[int]) -> tuple[list[slice], int]:
    """Consecutive segments of these sizes, each starting on a 16-byte boundary: Triton specialises pointer
    arguments on 16-byte alignment, so unaligned views would compile new kernel variants in the middle of a
    run, depending on the batch's row counts. Returns the slices and the total length."""
    out, at = [], 0
    for n in sizes:
        out.append(slice(at, at + n))
        at += _ALIGN * -(-n // _ALIGN)
    return out, at


def build_inputs(chunks: list[Chunk], block_size: int, device: torch.device, decode_width: int = 1,
                 stager: Stager | None = None, pad_prefills: bool = False,
                 table: DeviceBlockTable | None = None, with_states: bool = False,
                 windows: WindowDeviceTables | None = None) -> StepInputs:
    """Order chunks decode-first and flatten them into one batch of rows.

    decode_width: least width of the decode block table (the split-K factor of decode attention follows the
    table's width, so the runner pads eager tables like its graphs to keep both numerically identical).
    stager: the runner's pinned staging buffer (default: a plain copy).
    pad_prefills: pad the prefill sequence count to a power of two with empty sequences (cu_seqlens repeated,
    seq_len 0) and the prefill table width to a multiple of 16, so kernel specialisations recur (GPU runner).
    with_states: add the sequences' state slots (`SequenceStates`, hybrid models): a request's table row, or the
    scratch slot 0 without device state.
    table: the runner's persistent device state: rows send their table row and only the block ids and length
    corrections the device lacks (one scatter each), the tables are gathered on the device and the one-token
    rows' positions, slots and seq_lens computed there (which advances the table's lengths: every call with a
    table must be followed by the forward it builds). None: everything is built here, nothing on the device
    changes.
    windows: the sliding-window groups' device tables (with `table`): the groups' addresses come from them, like
    the decode graphs'; else from the requests' tables, built here (window_inputs.py).
    """
    decodes, prefills = order_chunks(chunks)
    ordered = decodes + prefills
    nd, npf = len(decodes), len(prefills)
    npad = padded_count(npf) - npf if pad_prefills else 0
    if table is not None:  # positions, slots and seq_lens of decode rows: table.advance on the device
        ids_d, rows_d = decode_ids(decodes, block_size)
        pos_d = slots_d = np.zeros(nd, dtype=np.int64)
    else:
        ids_d, pos_d, slots_d, rows_d = decode_rows(decodes, block_size)
    ids_l, pos_l, slots_l = [ids_d], [pos_d], [slots_d]
    row_starts = list(range(nd))
    cu = [0]
    for c in prefills:
        _check_blocks(c, block_size)
        end = c.start + c.num_tokens
        row_starts.append(nd + cu[-1])
        cu.append(cu[-1] + c.num_tokens)
        index = np.arange(c.start, end, dtype=np.int64)
        ids_l.append(np.asarray(c.state.token_ids[c.start : end], dtype=np.int64))
        pos_l.append(index if c.tree is None else c.start + tree_rows(c)[0])
        slots_l.append(c.state.block_array()[index // block_size] * block_size + index % block_size)
    t = nd + cu[-1]
    wd = table_width(decodes, decode_width) if nd else 1
    wp = -(-table_width(prefills) // 16) * 16 if pad_prefills else table_width(prefills)
    cu += [cu[-1]] * npad
    npf += npad
    # int64 head: ids, positions, slots, then with device tables the block-delta indices, the length
    # corrections (rows, values) and the decode rows' table rows (int64 like a graph's: one kernel variant);
    # int32 tail (cast on the device): seq lens, cu, then the delta's block ids and the prefill rows' table
    # rows (device tables) or the block tables themselves
    if table is not None:
        d_index, d_blocks = table.delta(c.state for c in ordered)
        corrections = table.lens_delta(ordered)
        k, m = d_index.shape[0], corrections.shape[1]
        sizes = [t, t, t, k, m, m, nd, nd, npf + 1, npf, k, npf]
    else:
        sizes = [t, t, t, 0, 0, 0, 0, nd, npf + 1, npf, nd * wd, npf * wp]
    seg, total = _layout(sizes)
    flat = np.zeros(total, dtype=np.int64)
    flat[seg[0]] = np.concatenate(ids_l)
    flat[seg[1]] = np.concatenate(pos_l)
    flat[seg[2]] = np.concatenate(slots_l)
    flat[seg[8]] = cu
    flat[seg[9]] = [c.start + c.num_tokens for c in prefills] + [0] * npad
    if table is not None:
        flat[seg[3]], flat[seg[4]], flat[seg[5]], flat[seg[6]] = d_index, corrections[0], corrections[1], rows_d
        flat[seg[10]] = d_blocks
        flat[seg[11]] = [c.state.table_row for c in prefills] + [0] * npad  # padding reads the zero row
    else:
        flat[seg[7]] = pos_d + 1
        fill_block_table(flat[seg[10]].reshape(nd, wd), decodes)
        fill_block_table(flat[seg[11]].reshape(npf, wp), prefills)
    split = seg[7].start
    if device.type == "cuda":  # one copy, then one cast launch for the int32 tail
        dev = (stager or Stager(device)).send(flat)
        head, tail = dev[:split], dev[split:].to(torch.int32)
    else:
        head = torch.from_numpy(flat[:split]).to(device)
        tail = torch.from_numpy(flat[split:].astype(np.int32)).to(device)
    o = [slice(x.start - split, x.stop - split) for x in seg[7:]]
    if table is not None:  # the deltas first: the gathers and the positions read the new entries
        table.apply(head[seg[3]], tail[o[3]])
        table.set_lens(head[seg[4]], head[seg[5]])
        rows = head[seg[6]]
        decode_slots = rows
        table.advance(rows, block_size, head[seg[1]][:nd], head[seg[2]][:nd], tail[o[0]])
        decode_tables, prefill_tables = table.gather(rows, wd), table.gather(tail[o[4]], wp)
        if windows is not None:
            window_meta = windows.step_windows(decodes, prefills, rows, tail[o[4]], head[seg[1]][:nd],
                                              head[seg[2]][:nd], wd, wp, block_size)
    else:
        decode_tables, prefill_tables = tail[o[3]].view(nd, wd), tail[o[4]].view(npf, wp)
        decode_slots = torch.zeros(nd, dtype=torch.int64, device=device)
    if table is None or windows is None:
        window_meta = window_tables(decodes, prefills, npad, wd, wp, block_size, device)
    states = None
    if with_states:
        rows_p = [c.state.table_row if table is not None else 0 for c in prefills]
        states = SequenceStates(decode_slots, rows_p, [c.start == 0 for c in prefills], cu[: len(prefills) + 1])
    meta = AttentionMetadata(
        slot_mapping=head[seg[2]],
        num_decode_tokens=nd,
        decode_block_tables=decode_tables,
        decode_seq_lens=tail[o[0]],
        prefill_cu_seqlens=tail[o[1]],
        prefill_seq_lens=tail[o[2]],
        prefill_block_tables=prefill_tables,
        decode_order=longest_first(tail[o[0]]),
        states=states,
        windows=window_meta,
        tree=tree_mask(prefills, npad, device),
    )
    return StepInputs(head[seg[0]], head[seg[1]], meta, ordered, row_starts)


def tree_rows(c: Chunk) -> tuple[np.ndarray, np.ndarray]:
    """A tree verification's rows (DraftTree.chunk_rows: position offsets, masks); its chunk is the root and nodes."""
    assert c.tree is not None
    if c.num_tokens != len(c.tree) + 1:
        raise ValueError(f"request {c.state.request_id!r}: a chunk of {c.num_tokens} tokens cannot verify a tree of "
                         f"{len(c.tree)} nodes (its root and nodes only)")
    return c.tree.chunk_rows()


def tree_mask(prefills: list[Chunk], npad: int, device: torch.device) -> TreeMask | None:
    """The prefill rows' draft-tree masks (None: no chunk verifies a tree). Trees run eagerly: a plain upload."""
    if all(c.tree is None for c in prefills):
        return None
    bits = [tree_rows(c)[1] if c.tree is not None else np.zeros(c.num_tokens, dtype=np.int64) for c in prefills]
    widths = [c.num_tokens if c.tree is not None else 0 for c in prefills] + [0] * npad
    return TreeMask(torch.from_numpy(np.concatenate(bits)).to(device),
                    torch.tensor(widths, dtype=torch.int32, device=device))


class Stager:
    """Host -> device copies through reused pinned buffers: one non-blocking copy per call. The buffers take
    turns, and one is overwritten only once its previous copy completed. In overlap mode a step's copies queue
    behind the step in flight, so waiting for the latest copy would hold the host until the device caught up
    (the sampler's parameters, sent after the forward, did so every step); waiting for the copy RING - 1 calls
    earlier does not."""

    RING = 2
    MIN_BYTES = 1 << 19  # a step's inputs at 8,192 tokens are ~200 KB

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # allocated now: pinning host memory takes milliseconds, which a first use mid-run would stall on
        self._bufs: list[torch.Tensor | None] = [self._pinned(self.MIN_BYTES) if device.type == "cuda" else None
                                                 for _ in range(self.RING)]
        self._events: list[torch.cuda.Event | None] = [None] * self.RING
        self._turn = 0

    @staticmethod
    def _pinned(nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8).pin_memory()

    def send(self, flat: np.ndarray) -> torch.Tensor:
        src = torch.from_numpy(flat)
        if self.device.type != "cuda":
            return src.to(self.device)
        i, self._turn = self._turn, (self._turn + 1) % self.RING
        event = self._events[i]
        if event is not None:
            event.synchronize()
        buf = self._bufs[i]
        if buf is None or buf.numel() < flat.nbytes:
            buf = self._bufs[i] = self._pinned(max(flat.nbytes, self.MIN_BYTES))
        staged = buf[: flat.nbytes].view(src.dtype).view(src.shape)
        staged.copy_(src)
        out = staged.to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._events[i] = done
        return out
