"""store_kv, decode_attention and prefill_attention on flashinfer's paged kernels.

Our caches are [num_blocks, block_size, Hkv, D]: flashinfer's "NHD" layout with page_size = block_size, passed
as the (k_cache, v_cache) pair. Block tables become flashinfer's CSR page lists once per step (plans.py).
"""
from __future__ import annotations

import numpy as np
import torch

from appliance.kernels.flashinfer import plans
from appliance.kernels.reference.attention import attention_out
from appliance.kernels.registry import register

DECODE_GROUPS = (1, 2, 3, 4, 8)  # query heads per kv head that flashinfer's CUDA-core decode dispatches on


def _store_rows(slot_mapping: torch.Tensor, capacity: int) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(rows to keep or None for all, their slots as int32 positions); checked on the host once per step."""
    host = slot_mapping.cpu().numpy()
    if host.size and int(host.max()) >= capacity:
        raise ValueError(f"flashinfer store_kv: slot {int(host.max())} is outside the cache ({capacity} slots)")
    keep = host >= 0
    if keep.all():
        return None, slot_mapping.to(torch.int32)
    rows = torch.from_numpy(np.flatnonzero(keep)).to(slot_mapping.device)
    return rows, slot_mapping.index_select(0, rows).to(torch.int32)


@register("store_kv", "flashinfer")
def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Slots are addressed as positions of one sequence that owns every page in order (indptr [0, num_blocks],
    indices = arange): page = slot // block_size, offset = slot % block_size, as in the reference. Rows with
    slot -1 are dropped (the kernel has no skip), found on the host with the step's one read of the slots."""
    if key.shape[0] == 0:
        return
    plans.check_attention_inputs("store_kv", k_cache, k_cache)  # key is cast to the cache dtype
    import flashinfer

    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    st = plans.state(key.device)
    rows, positions = st.store_plan.get((slot_mapping,), num_blocks * block_size,
                                        lambda: _store_rows(slot_mapping, num_blocks * block_size))
    if rows is not None:
        if rows.numel() == 0:
            return
        key, value = key.index_select(0, rows), value.index_select(0, rows)
    key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    n = key.shape[0]
    if st.zeros is None or st.zeros.numel() < n:
        st.zeros = torch.zeros(max(n, 8192), dtype=torch.int32, device=key.device)
    pages, indptr, last = plans.store_pages(st, num_blocks, block_size, key.device)
    flashinfer.append_paged_kv_cache(key, value, st.zeros[:n], positions, (k_cache, v_cache), pages, indptr, last,
                                     kv_layout="NHD")


_DECODE_COMPILED: set[tuple[object, ...]] = set()  # shapes whose decode module is built (planned once)


def _decode_key(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[object, ...]:
    return (q.device, q.dtype, q.shape[1], q.shape[2], tuple(k_cache.shape[1:]), k_cache.dtype)


def _check_decode_group(q: torch.Tensor, k_cache: torch.Tensor) -> None:
    group, rest = divmod(q.shape[1], k_cache.shape[2])
    if rest or group not in DECODE_GROUPS:
        raise ValueError(f"flashinfer decode_attention: {q.shape[1]} query heads over {k_cache.shape[2]} kv heads; "
                         f"its CUDA-core decode kernels take GQA groups of {DECODE_GROUPS} (the tensor-core variant, "
                         "which takes any, is not wired): use backends.attention = triton")


def _plan_decode(q: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float) -> None:
    seq = seq_lens.cpu().numpy().astype(np.int64)  # the step's host sync
    layout = plans.paged_layout(seq, np.arange(len(seq)), block_tables, k_cache.shape[1])
    plans.state(q.device).decode.plan(
        layout.indptr, layout.indices, layout.last_page_len, q.shape[1], k_cache.shape[2], q.shape[2],
        k_cache.shape[1], q_data_type=q.dtype, kv_data_type=k_cache.dtype, sm_scale=scale)
    _DECODE_COMPILED.add(_decode_key(q, k_cache))


def _into(result: torch.Tensor, dest: torch.Tensor | None) -> torch.Tensor:
    """flashinfer's result, copied into the caller's checked `out` when there is one."""
    return result if dest is None else dest.copy_(result)


@register("decode_attention", "flashinfer")
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, order: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`order` (the Triton kernel's row order) does not apply: flashinfer's plan balances the work itself. `out`
    receives a copy of the result (attention_out)."""
    plans.check_attention_inputs("decode_attention", q, k_cache)
    _check_decode_group(q, k_cache)
    dest = None if out is None else attention_out("decode_attention", q, out)  # checked before any work
    if q.shape[0] == 0:
        return torch.empty_like(q) if dest is None else dest
    st = plans.state(q.device)
    shape = (tuple(q.shape[1:]), tuple(k_cache.shape[1:]), q.dtype, float(scale))
    st.decode_plan.get((block_tables, seq_lens), shape,
                       lambda: _plan_decode(q, k_cache, block_tables, seq_lens, scale))
    return _into(st.decode.run(q.contiguous(), (k_cache, v_cache)), dest)


def _compile_decode_once(q: torch.Tensor, k_cache: torch.Tensor, scale: float) -> None:
    """Plan the decode wrapper once for these shapes, from the first prefill: planning JIT-compiles its module
    (~11 s on a fresh machine), so the runner's start-up forward (a prefill) pays it instead of the first served
    decode step. The throwaway plan is forgotten, so the next decode call plans its own step."""
    key = _decode_key(q, k_cache)
    if key in _DECODE_COMPILED:
        return
    _check_decode_group(q, k_cache)  # a model decode cannot serve fails at start-up, not at its first decode
    st = plans.state(q.device)
    one = torch.zeros(1, dtype=torch.int32, device=q.device)
    st.decode.plan(torch.tensor([0, 1], dtype=torch.int32), one, torch.ones(1, dtype=torch.int32), q.shape[1],
                   k_cache.shape[2], q.shape[2], k_cache.shape[1], q_data_type=q.dtype, kv_data_type=k_cache.dtype,
                   sm_scale=scale)
    st.decode_plan.forget()
    _DECODE_COMPILED.add(key)


def _plan_prefill(q: torch.Tensor, k_cache: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens: torch.Tensor,
                  block_tables: torch.Tensor, scale: float) -> int:
    """Plans the sequences that have query rows (the runner pads the count with empty ones); returns the rows."""
    n = seq_lens.shape[0]
    host = torch.cat((cu_seqlens_q.to(torch.int64), seq_lens.to(torch.int64))).cpu().numpy()  # one sync
    cu, seq = host[: n + 1], host[n + 1 :]
    q_lens = np.diff(cu)
    if (q_lens > seq).any():
        raise ValueError("flashinfer prefill_attention: a sequence has more query rows than tokens")
    _compile_decode_once(q, k_cache, scale)
    rows = np.flatnonzero(q_lens > 0)
    qo = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(q_lens[rows], out=qo[1:])
    layout = plans.paged_layout(seq[rows], rows, block_tables, k_cache.shape[1])
    if len(rows):
        plans.state(q.device).prefill.plan(
            torch.from_numpy(qo), layout.indptr, layout.indices, layout.last_page_len, q.shape[1],
            k_cache.shape[2], q.shape[2], k_cache.shape[1], causal=True, sm_scale=scale, q_data_type=q.dtype,
            kv_data_type=k_cache.dtype)
    return int(qo[-1])


@register("prefill_attention", "flashinfer")
def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                      seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal with the mask aligned to the end of each sequence (flashinfer's convention for kv_len > q_len):
    query j of sequence b sits at position seq_lens[b] - q_len_b + j and sees the cached prefix."""
    plans.check_attention_inputs("prefill_attention", q, k_cache)
    dest = None if out is None else attention_out("prefill_attention", q, out)  # checked before any work
    st = plans.state(q.device)
    shape = (tuple(q.shape[1:]), tuple(k_cache.shape[1:]), q.dtype, float(scale))
    rows = st.prefill_plan.get((cu_seqlens_q, seq_lens, block_tables), shape,
                               lambda: _plan_prefill(q, k_cache, cu_seqlens_q, seq_lens, block_tables, scale))
    if rows != q.shape[0]:
        raise ValueError(f"flashinfer prefill_attention: q has {q.shape[0]} rows, cu_seqlens_q says {rows}")
    if rows == 0:
        return torch.empty_like(q) if dest is None else dest
    return _into(st.prefill.run(q.contiguous(), (k_cache, v_cache)), dest)
