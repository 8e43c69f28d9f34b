"""A CPU stand-in for the flashinfer module, written from its documented semantics (wrappers that plan once and
run per layer, append_paged_kv_cache, the norms and silu_and_mul), so tests/test_flashinfer_backend.py can run the
backend's glue against the torch reference without a GPU."""
from __future__ import annotations

import itertools
import types
from typing import Any

import torch


def _fake_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, scale: float) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).double(), v.repeat_interleave(group, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    q_pos = torch.arange(first_pos, first_pos + q.shape[0])
    s.masked_fill_(torch.arange(k.shape[0])[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v).to(q.dtype)


class _FakeWrapper:
    """flashinfer's paged wrappers as documented: CSR page lists (indptr/last_page_len on the host), causal mask
    aligned to the end of each sequence (query i of q_len at kv_len - q_len + i)."""

    plans = 0

    def __init__(self, workspace: torch.Tensor, layout: str) -> None:
        assert layout == "NHD"
        self.p: dict[str, Any] = {}

    def _plan(self, qo: list[int], indptr: torch.Tensor, indices: torch.Tensor, last: torch.Tensor,
              dims: tuple[int, ...], scale: float) -> None:
        assert indptr.device.type == "cpu" and last.device.type == "cpu"
        assert indptr.dtype == indices.dtype == last.dtype == torch.int32
        assert all(b > a for a, b in itertools.pairwise(qo)), "a sequence without query rows reached the planner"
        type(self).plans += 1
        self.p = {"qo": qo, "indptr": indptr.tolist(), "indices": indices.long().clone(), "last": last.tolist(),
                  "dims": dims, "scale": scale}

    def run(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        p = self.p
        kc, vc = kv
        assert (q.shape[1], kc.shape[2], q.shape[2], kc.shape[1]) == p["dims"][:4] and q.dtype == p["dims"][4]
        assert q.shape[0] == p["qo"][-1]
        out = torch.zeros_like(q)
        for b in range(len(p["qo"]) - 1):
            pages = p["indices"][p["indptr"][b] : p["indptr"][b + 1]]
            assert len(pages) and 1 <= p["last"][b] <= kc.shape[1]
            n = (len(pages) - 1) * kc.shape[1] + p["last"][b]
            s, e = p["qo"][b], p["qo"][b + 1]
            out[s:e] = _fake_attend(q[s:e], kc[pages].flatten(0, 1)[:n], vc[pages].flatten(0, 1)[:n], n - (e - s),
                                    p["scale"])
        return out


class _FakeDecode(_FakeWrapper):
    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, h: int, hkv: int,
             d: int, page_size: int, *, q_data_type: torch.dtype, kv_data_type: torch.dtype, sm_scale: float) -> None:
        self._plan(list(range(len(last_page_len) + 1)), indptr, indices, last_page_len,
                   (h, hkv, d, page_size, q_data_type),
                   sm_scale)


class _FakePrefill(_FakeWrapper):
    def plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             h: int, hkv: int, d: int, page_size: int, *, causal: bool, sm_scale: float, q_data_type: torch.dtype,
             kv_data_type: torch.dtype) -> None:
        assert causal
        self._plan(qo_indptr.tolist(), indptr, indices, last_page_len, (h, hkv, d, page_size, q_data_type), sm_scale)


def _fake_append(key: torch.Tensor, value: torch.Tensor, batch_indices: torch.Tensor, positions: torch.Tensor,
                 cache: tuple[torch.Tensor, torch.Tensor], kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_last_page_len: torch.Tensor, kv_layout: str = "NHD") -> None:
    """The append kernel's addressing: divmod(indptr[batch] * page_size + position, page_size) = (page_iter, entry),
    with no way to skip a row (a negative position would write out of bounds on the GPU)."""
    kc, vc = cache
    page_size = kc.shape[1]
    assert batch_indices.dtype == positions.dtype == torch.int32 and len(positions) == key.shape[0]
    assert int(positions.min()) >= 0
    flat = kv_indptr.long()[batch_indices.long()] * page_size + positions.long()
    blocks = kv_indices.long()[flat // page_size]
    kc[blocks, flat % page_size] = key
    vc[blocks, flat % page_size] = value


def _fake_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    assert x.dim() in (2, 3) and x.stride(-1) == 1 and w.dtype == x.dtype
    h = x.double()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)


def _fake_fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float) -> None:
    """In place, like flashinfer's: residual <- x + residual, x <- rmsnorm(residual)."""
    assert x.dim() == 2 and x.is_contiguous() and residual.is_contiguous() and residual.dtype == x.dtype
    residual.copy_((x.double() + residual.double()).to(x.dtype))
    x.copy_(_fake_rmsnorm(residual, w, eps))


def _fake_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    assert x.is_contiguous()
    gate, up = x.double().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def _fake_module() -> types.ModuleType:
    m = types.ModuleType("flashinfer")
    decode = type("BatchDecodeWithPagedKVCacheWrapper", (_FakeDecode,), {"plans": 0})
    prefill = type("BatchPrefillWithPagedKVCacheWrapper", (_FakePrefill,), {"plans": 0})
    m.BatchDecodeWithPagedKVCacheWrapper, m.BatchPrefillWithPagedKVCacheWrapper = decode, prefill  # type: ignore
    m.append_paged_kv_cache = _fake_append  # type: ignore[attr-defined]
    m.rmsnorm, m.fused_add_rmsnorm, m.silu_and_mul = _fake_rmsnorm, _fake_fused_add_rmsnorm, _fake_silu_and_mul
    return m
