"""Per-step planning of flashinfer's paged-attention wrappers behind our per-layer op signatures.

flashinfer's batch wrappers split attention into `plan()` (host-side: page index arrays, work partition, copied
to the device) and `run()` (the kernel). Our ops are called once per layer with the step's metadata tensors, so
each wrapper remembers the metadata tensors it was last planned for and plans again only when a call brings
different ones: one plan per step, reused by every layer.

Cost: planning reads the step's sequence lengths back to the host (one device -> host sync per step for decode,
one for prefill, one for store_kv's slot check) and uploads the page indptr/indices. In an eager step that
stalls the host until the GPU has run the step so far (layer 0's projections), so overlap scheduling gains
little with this backend.

The key is the identity of the metadata tensors (kernels/step_cache.py): the runner builds them anew every eager
step. A rewrite of the same tensor in place (CUDA graphs' static buffers) would not be noticed; graphs are off
for this backend (executor/cuda_graph.py graph_settings).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from appliance.kernels.step_cache import StepCache

WORKSPACE_BYTES = 128 * 1024 * 1024  # flashinfer's recommended float workspace (split-K partial results)
HALF = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)  # the head sizes flashinfer's paged append and prefill kernels dispatch on


@dataclass
class DeviceState:
    """Per device: one shared float workspace (decode and prefill run one after the other on one stream, as
    SGLang and vLLM share theirs), the two wrappers and their step caches, the store's page map."""

    workspace: torch.Tensor
    decode: Any
    prefill: Any
    decode_plan: StepCache
    prefill_plan: StepCache
    store_plan: StepCache
    # store_kv's page map per cache shape: (indices = arange(num_blocks), indptr [0, num_blocks], last page len)
    store_pages: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    zeros: torch.Tensor | None = None  # batch index 0 for every appended row


_STATES: dict[torch.device, DeviceState] = {}


def state(device: torch.device) -> DeviceState:
    import flashinfer

    if device not in _STATES:
        ws = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        _STATES[device] = DeviceState(
            ws, flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD"),
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD"), StepCache(), StepCache(), StepCache())
    return _STATES[device]


def check_attention_inputs(op: str, q: torch.Tensor, k_cache: torch.Tensor) -> None:
    """Clear errors for what the kernels cannot take (the runner's first forward, at start-up, meets them)."""
    if not q.is_cuda:
        raise ValueError(f"flashinfer {op}: needs CUDA tensors, got {q.device}")
    if q.dtype not in HALF or k_cache.dtype != q.dtype:
        raise ValueError(f"flashinfer {op}: supports float16/bfloat16 inputs and a KV cache of the same dtype, got "
                         f"{q.dtype} and cache {k_cache.dtype}; use backends.attention = triton for other dtypes")
    if q.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"flashinfer {op}: head_dim {q.shape[-1]} is not one of {HEAD_DIMS}; "
                         "use backends.attention = triton")


def store_pages(st: DeviceState, num_blocks: int, block_size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Made once per cache shape: a host -> device tensor per call would sync every layer."""
    key = (num_blocks, block_size)
    if key not in st.store_pages:
        st.store_pages[key] = (torch.arange(num_blocks, dtype=torch.int32, device=device),
                               torch.tensor([0, num_blocks], dtype=torch.int32, device=device),
                               torch.tensor([block_size], dtype=torch.int32, device=device))
    return st.store_pages[key]


@dataclass(frozen=True)
class PagedLayout:
    """flashinfer's CSR page layout of some rows of a block table (host arrays, device indices)."""

    indptr: torch.Tensor  # [n+1] int32, host
    indices: torch.Tensor  # [indptr[-1]] int32, device
    last_page_len: torch.Tensor  # [n] int32, host


def paged_layout(seq_lens: np.ndarray, rows: np.ndarray, block_tables: torch.Tensor, block_size: int) -> PagedLayout:
    """The pages of block_tables[rows] that hold seq_lens tokens each, as flashinfer's indptr/indices/last_page_len.
    The flat positions of those pages in the table are computed here and gathered on the device in one launch."""
    width = block_tables.shape[1]
    npages = (seq_lens + block_size - 1) // block_size
    if npages.size and int(npages.max()) > width:
        raise ValueError(f"flashinfer attention: a sequence of {int(seq_lens.max())} tokens needs "
                         f"{int(npages.max())} pages but the block table has {width} columns")
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int64)
    np.cumsum(npages, out=indptr[1:])
    total = int(indptr[-1])
    starts = np.repeat(rows.astype(np.int64) * width, npages)
    offsets = np.arange(total, dtype=np.int64) - np.repeat(indptr[:-1], npages)
    flat = torch.from_numpy(starts + offsets).to(block_tables.device, non_blocking=True)  # staged at once
    indices = block_tables.reshape(-1).index_select(0, flat).to(torch.int32)
    last = np.where(seq_lens > 0, seq_lens - (npages - 1) * block_size, 0)
    return PagedLayout(torch.from_numpy(indptr.astype(np.int32)), indices,
                       torch.from_numpy(last.astype(np.int32)))
