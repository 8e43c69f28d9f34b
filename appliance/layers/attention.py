"""Paged attention layer: stores this step's K/V into the cache, then attends over the cache.

`forward(q, k, v, meta)` does both; a model whose prologue already wrote the cache (the fused `rope_store_kv`
op, see `fused_rope_store`) calls `attend(q, meta)`.

One forward mixes decodes and prefill chunks. The runner puts the single-token rows first (they go through
`decode_attention`) and the multi-token chunks after them (`prefill_attention`, which also sees the cached
prefix), so both kernels get contiguous slices.

Two per-layer properties reach the kernels as keywords (only when set, so every backend serves plain layers):
`sliding_window` (Gemma 3's local layers, gpt-oss's banded layers) and `sinks`, one learned logit per query
head that joins the softmax (gpt-oss). Backends that lack them are refused when the layer is built.

A sliding-window layer whose cache is its KV cache group's own (engine/kv_groups.py: `kv_group` >= 1, set by the
model runner) reads and writes it through that group's slots and tables (`AttentionMetadata.windows`, picked
by `group_meta`); group 0 (every layer of a model without sliding groups) uses the metadata's own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch import nn

from appliance.kernels import registry
from appliance.kernels.reference.kv_quant import is_fp8
from appliance.layers.kernels import kernel
from appliance.layers.parallel_state import get_tp_rank, get_tp_size

# attention backends whose decode and prefill kernels take sliding_window= and sinks=
WINDOW_SINK_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class SequenceStates:
    """Where each sequence of a step keeps its recurrent state (executor/state_cache.py): the slot is the
    request's device table row (0: the scratch slot of padding and of steps without request rows). A sequence
    whose chunk starts at position 0 starts from zero state instead of reading its slot."""

    decode_slots: torch.Tensor  # [Bd] int64, on the device
    prefill_slots: list[int]
    prefill_fresh: list[bool]
    prefill_cu_seqlens: list[int]  # host copy of the prefill offsets (the reference kernels loop over sequences)


@dataclass(frozen=True)
class WindowTables:
    """A sliding-window KV cache group's own addresses for one step (its blocks are its pool's)."""

    slot_mapping: torch.Tensor  # [T] int64
    decode_block_tables: torch.Tensor  # [Bd, M] int32
    prefill_block_tables: torch.Tensor  # [Bp, M] int32


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64, cache slot of every row (-1: do not store)
    num_decode_tokens: int  # rows [0, num_decode_tokens) are one-token requests
    decode_block_tables: torch.Tensor  # [Bd, M] int32
    decode_seq_lens: torch.Tensor  # [Bd] int32, context length including the new token
    prefill_cu_seqlens: torch.Tensor  # [Bp+1] int32, offsets into the prefill rows
    prefill_seq_lens: torch.Tensor  # [Bp] int32
    prefill_block_tables: torch.Tensor  # [Bp, M] int32
    decode_order: torch.Tensor | None = None  # [Bd] the decode rows longest first (longest_first), or row order
    states: SequenceStates | None = None  # state slots of the linear-attention layers (hybrid models only)
    windows: tuple[WindowTables, ...] = ()  # each sliding-window KV cache group's (Attention.kv_group - 1)
    # newest cache rows of each decode row stored by this step's kernels: 1, or a verification's rows per request
    # (executor/verify_graphs.py), which the decode kernel must not read before they are written
    decode_fresh_rows: int = 1

    @property
    def num_prefills(self) -> int:
        return int(self.prefill_seq_lens.shape[0])


# Decode batches of at least this many rows take their sequences longest first (the decode kernel's `order`): on
# large batches one program per SM runs at a time, and a long sequence started last runs alone at the end. Measured
# on ragged Qwen3 batches (docs/kernels.md, "Decode attention: longest sequence first"): 2.4-4.1% faster from 96
# rows up, 2-4% slower at 32 and 64.
LONGEST_FIRST_MIN_ROWS = 96


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor | None:
    """The decode rows' order for the kernel, longest context first (one sort on the device, no host sync; once per
    step, shared by every layer), or None below LONGEST_FIRST_MIN_ROWS rows."""
    if seq_lens.shape[0] < LONGEST_FIRST_MIN_ROWS:
        return None
    return torch.argsort(seq_lens, descending=True)


# Set by executor/piecewise.py while it captures a forward in pieces: attend() hands q over and returns what the
# hook gives (the static buffer the eager attention writes at replay), ending the piece there.
PieceBreak = Callable[["Attention", torch.Tensor], torch.Tensor]
_piece_break: PieceBreak | None = None


def set_piece_break(hook: PieceBreak | None) -> PieceBreak | None:
    """Install (or clear, with None) the piece-break hook; returns the one installed before."""
    global _piece_break
    previous, _piece_break = _piece_break, hook
    return previous


class KVObserver(Protocol):
    """Sees a layer's keys and values before they are stored (executor/kv_calibration.py: online fp8 scales)."""

    def observe(self, layer: Attention, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None: ...


def fused_rope_store(backend: str) -> Callable[..., Any] | None:
    """The attention backend's `rope_store_kv` (norm + rotary + KV store in one op), or None when that backend
    has none: the caller then runs norm, rope and `store_kv` separately. Never another backend's version: the op
    writes the KV cache, whose layout belongs to the attention backend."""
    try:
        return registry.get("rope_store_kv", backend)
    except KeyError:
        return None


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float, backend: str = "torch",
                 sliding_window: int | None = None, sinks: bool = False) -> None:
        """num_heads / num_kv_heads: this rank's. `sliding_window`: keys older than the last W tokens are hidden;
        `sinks`: a `sinks` parameter of this rank's heads (the checkpoint's [all heads] tensor is sliced)."""
        super().__init__()
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        if (sliding_window is not None or sinks) and backend not in WINDOW_SINK_BACKENDS:
            raise ValueError(f"backends.attention = {backend!r} has no sliding-window / attention-sink kernels, "
                             f"which this model needs (supported: {', '.join(WINDOW_SINK_BACKENDS)})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.sliding_window = sliding_window
        self.kv_group = 0  # 0: the full group's addresses; g >= 1: sliding group g's (AttentionMetadata.windows)
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False)
            self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]
        else:
            self.register_parameter("sinks", None)
        self.backend = backend
        self._store = kernel("store_kv", backend)
        self._decode = kernel("decode_attention", backend)
        self._prefill = kernel("prefill_attention", backend)
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # an fp8 cache's per-kv-head scales ([Hkv] float32: stored = x / scale), set by the runner (executor/
        # kv_scales.py) before a cache is bound; read by every op that touches the cache, through `kv_scales`
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.kv_scales: dict[str, torch.Tensor] = {}  # the ops' scale keywords for the bound cache ({} if 16-bit)
        # called before every use of the cache: the host tier's copies of this layer are waited for here
        # (executor/host_copy.py), so the layers before it compute meanwhile
        self.kv_ready: Callable[[], None] | None = None
        # set while online KV scale calibration is open: stores go through `forward`, which shows it K and V first
        self.calibration: KVObserver | None = None

    def set_kv_scales(self, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
        for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
            if t.shape != (self.num_kv_heads,) or t.dtype != torch.float32:
                raise ValueError(f"{name} {tuple(t.shape)} {t.dtype} is not [{self.num_kv_heads}] float32")
        self.k_scale, self.v_scale = k_scale, v_scale

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.num_heads * get_tp_size(),):
            raise ValueError(f"sinks of shape {tuple(loaded.shape)} do not fit {self.num_heads * get_tp_size()} heads")
        param.data.copy_(loaded.narrow(0, get_tp_rank() * self.num_heads, self.num_heads))

    def _extra(self) -> dict[str, Any]:
        """The window / sink keywords of this layer's kernels (none for a plain layer)."""
        extra: dict[str, Any] = {}
        if self.sliding_window is not None:
            extra["sliding_window"] = self.sliding_window
        if self.sinks is not None:
            extra["sinks"] = self.sinks
        return extra

    def decode_unsplit_from(self, device: torch.device) -> int | None:
        """The smallest decode batch whose attention launch is the same at every block-table width (no split-K),
        or None where the backend's launch always depends on it: the decode graphs share one width from there
        (executor/cuda_graph.py)."""
        if self.backend != "triton":
            return None
        from appliance.kernels.triton.decode import unsplit_from

        return unsplit_from(self.num_kv_heads, device)

    def bind_kv_cache(self, k_cache: torch.Tensor | None, v_cache: torch.Tensor | None) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache
        self.kv_scales = {}
        if k_cache is not None and is_fp8(k_cache.dtype):
            if self.k_scale is None or self.v_scale is None:
                self.set_kv_scales(*(torch.ones(self.num_kv_heads, device=k_cache.device) for _ in range(2)))
            assert self.k_scale is not None and self.v_scale is not None
            self.k_scale, self.v_scale = self.k_scale.to(k_cache.device), self.v_scale.to(k_cache.device)
            self.kv_scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}

    def kv_cache(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("attention layer has no KV cache bound; the model runner allocates it")
        if self.kv_ready is not None:
            self.kv_ready()
        return self.k_cache, self.v_cache

    def group_meta(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The metadata addressing this layer's cache: its KV cache group's slots and tables."""
        if not self.kv_group:
            return meta
        w = meta.windows[self.kv_group - 1]
        return replace(meta, slot_mapping=w.slot_mapping, decode_block_tables=w.decode_block_tables,
                       prefill_block_tables=w.prefill_block_tables, windows=())

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        k_cache, v_cache = self.kv_cache()
        t = q.shape[0]
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.calibration is not None:
            self.calibration.observe(self, k, v, meta)
        self._store(k, v, k_cache, v_cache, self.group_meta(meta).slot_mapping, **self.kv_scales)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of q ([T, H * D] or [T, H, D]) over the cache, which already holds this step's K/V; written
        into `out` ([T, H * D]) when given."""
        if _piece_break is not None:
            return _piece_break(self, q)
        meta = self.group_meta(meta)
        k_cache, v_cache = self.kv_cache()
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        out = None if out is None else out.view(t, self.num_heads, self.head_dim)
        nd = meta.num_decode_tokens
        extra = {**self._extra(), **self.kv_scales}  # window / sinks and an fp8 cache's scales
        fresh = {} if meta.decode_fresh_rows == 1 else {"fresh_rows": meta.decode_fresh_rows}
        # one kind of row (every decode step, most prefill steps): the kernel's output is the answer, no copy
        if nd == t:
            return self._decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                                order=meta.decode_order, out=out, **extra,
                                **fresh).view(t, self.num_heads * self.head_dim)
        if nd == 0:
            return self._prefill(q, k_cache, v_cache, meta.prefill_cu_seqlens, meta.prefill_seq_lens,
                                 meta.prefill_block_tables, self.scale, out=out,
                                 **extra).view(t, self.num_heads * self.head_dim)
        out = torch.empty_like(q) if out is None else out  # both kernels write their rows of it
        if nd:
            self._decode(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_seq_lens, self.scale,
                         order=meta.decode_order, out=out[:nd], **extra, **fresh)
        if nd < t:
            self._prefill(q[nd:], k_cache, v_cache, meta.prefill_cu_seqlens, meta.prefill_seq_lens,
                          meta.prefill_block_tables, self.scale, out=out[nd:], **extra)
        return out.view(t, self.num_heads * self.head_dim)
