"""Paged decode attention: one query token per sequence over its paged KV cache.

One program serves all query heads that share a kv head (GQA: the kv tiles are read once per group, not once per
query head) over one split of the context. The split count is chosen on the host from the block table's width
(its capacity), never from seq_lens, so no host sync happens and the launch is CUDA-graph safe; splits that start
past a sequence's end exit at once. With more than one split a second pass merges the partial results by their
log-sum-exp; splits of one tile (small batches) run _decode_tile_kernel, which reads the cache before waiting for
the kernel before it. Programs are numbered kv head fastest: a sequence's heads run side by side, reading neighbouring
bytes of each cache row. An optional `order` (the rows longest context first, layers/attention.py
`longest_first`) says which sequence each program row serves: one program per SM runs at a time on large batches,
and starting the longest first keeps the last ones from running alone at the end of the launch.
"""
from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from appliance.kernels.reference.attention import attention_out
from appliance.kernels.registry import register
from appliance.kernels.triton.common import (
    INTERPRET,
    LOG2E,
    mma,
    pdl_enter,
    pdl_kwargs,
)
from appliance.kernels.triton.kv_fp8 import kv_fp8_args

_SMS_FALLBACK = 132
# Tuned on the H100 (docs/kernels.md): the tile of kv tokens per loop step, and the split-K heuristic inputs.
BLOCK_N = 64
# unsplit launches (large batches) take longer tiles: ragged Qwen3-shaped batches of 32 / 128 / 256 sequences ran
# 53.5 / 204.6 / 397.7 us against 55.2 / 212.5 / 403.8 with 64 (an H100); head_dim <= 128 only, as
# three stages of 128-token K and V tiles of a wider head would not fit the shared memory
BLOCK_N_UNSPLIT = 128
MIN_SPLIT_TOKENS = 64  # measured: b1 x kv1024 in a 2048-token table: 32 splits 6.4 us, 8 splits 9.3 us
PROGRAMS_PER_SM = 2  # measured: b64 x kv1024 (512 programs) is fastest unsplit
NUM_WARPS = 4
NUM_STAGES = 3
# Splits of one tile (small batches) run _decode_tile_kernel, which reads all but q and the newest cache row before
# its wait.


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, order_ptr, out_ptr, mid_o_ptr, mid_lse_ptr, qk_scale,
                   k_scale_ptr, v_scale_ptr,
                   stride_qb, stride_qh, stride_ob, stride_oh,
                   stride_cb, stride_cs, stride_ch, stride_bt,
                   split_tokens, num_splits,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DIRECT: tl.constexpr, ORDERED: tl.constexpr,
                   UPCAST: tl.constexpr, GDC: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                   window=0, sinks_ptr=None, WINDOW: tl.constexpr = False, SINKS: tl.constexpr = False):
    pdl_enter(GDC)  # q, the lengths and the newest cache row come from the kernels before
    kvh = tl.program_id(0)  # kv head fastest: a sequence's heads run side by side (docs/kernels.md)
    b = tl.program_id(1)
    if ORDERED:
        b = tl.load(order_ptr + b).to(tl.int32)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    start = split * split_tokens
    end = tl.minimum(start + split_tokens, seq_len)
    if WINDOW:  # keys before the window: splits wholly before it are empty, the one it starts in starts there
        start = tl.maximum(start, seq_len - window)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    head = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < D
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:  # the head's k scale goes into the softmax scale, its v scale onto the output
        qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        n_mask = pos < end
        blk = tl.load(bt_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        row = blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = mma(q, tl.trans(k), UPCAST) * qk_scale  # [BLOCK_H, BLOCK_N], in log2 units
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p.to(v.dtype), v, UPCAST)
        m_i = m_new
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kvh)

    out_mask = h_mask[:, None] & d_mask[None, :]
    if DIRECT:
        if SINKS:  # the sink joins the softmax's denominator only
            m_i, l_i, acc = _with_sink(sinks_ptr, head, h_mask, m_i, l_i, acc)
        o = acc / tl.maximum(l_i, 1e-30)[:, None]  # seq_len 0 (a padding row) gives zeros, like the reference
        tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        _store_partial(mid_o_ptr, mid_lse_ptr, acc, l_i, m_i, b, head, split, num_splits, offs_d, h_mask, out_mask,
                       GROUP, D)


@triton.jit
def _with_sink(sinks_ptr, head, h_mask, m_i, l_i, acc):
    """Fold each head's sink logit (natural units, like the scaled scores) into a finished online softmax."""
    sink = tl.load(sinks_ptr + head, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def _store_partial(mid_o_ptr, mid_lse_ptr, acc, l_i, m_i, b, head, split, num_splits, offs_d, h_mask, out_mask,
                   GROUP: tl.constexpr, D: tl.constexpr):
    """One split's partial result: mid_o [B, H, S, D] normalised, mid_lse [B, H, S] in log2 units (-inf for an
    empty split)."""
    base = (b * (GROUP * tl.num_programs(0)) + head) * num_splits + split
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(mid_o_ptr + base[:, None] * D + offs_d[None, :], o, mask=out_mask)
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
    tl.store(mid_lse_ptr + base, lse, mask=h_mask)


@triton.jit
def _decode_tile_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, order_ptr, mid_o_ptr, mid_lse_ptr, qk_scale,
                        k_scale_ptr, v_scale_ptr,
                        stride_qb, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, num_splits, fresh_rows,
                        GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                        BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, ORDERED: tl.constexpr, UPCAST: tl.constexpr,
                        GDC: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, window=0,
                        WINDOW: tl.constexpr = False):
    """Splits of one BLOCK_N-token tile each (small batches). Only q and each sequence's newest `fresh_rows`
    cache rows come from the kernels before (a decode row adds one token; a verification step stores all of a
    request's rows, one per query, before attending); the lengths, the block table and every older row were
    written before this step's first kernel. So those are read before the wait: under programmatic dependent
    launch the programs run while the qkv projection streams, and after the wait only q and the fresh rows."""
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    if ORDERED:
        b = tl.load(order_ptr + b).to(tl.int32)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    pos = split * BLOCK_N + offs_n
    n_mask = pos < seq_len
    if WINDOW:
        n_mask = n_mask & (pos >= seq_len - window)
    blk = tl.load(bt_ptr + b * stride_bt + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    rows = (blk * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kvh * stride_ch)[:, None] + offs_d[None, :]
    older = (pos < seq_len - fresh_rows)[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + rows, mask=older, other=0.0)
    v = tl.load(v_ptr + rows, mask=older, other=0.0)
    pdl_enter(GDC)
    newest = ((pos >= seq_len - fresh_rows) & n_mask)[:, None] & d_mask[None, :]
    k = tl.where(newest, tl.load(k_ptr + rows, mask=newest, other=0.0), k)
    v = tl.where(newest, tl.load(v_ptr + rows, mask=newest, other=0.0), v)
    offs_h = tl.arange(0, BLOCK_H)
    head = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    if KV_FP8:  # as in _decode_kernel
        k = k.to(q.dtype)
        v = v.to(q.dtype)
        qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)
    s = tl.where(n_mask[None, :], mma(q, tl.trans(k), UPCAST) * qk_scale, float("-inf"))
    m_i = tl.max(s, 1)
    p = tl.exp2(s - tl.where(m_i == float("-inf"), 0.0, m_i)[:, None])  # an empty split: p = 0, l = 0
    l_i = tl.sum(p, 1)
    acc = mma(p.to(v.dtype), v, UPCAST)
    if KV_FP8:
        acc = acc * tl.load(v_scale_ptr + kvh)
    _store_partial(mid_o_ptr, mid_lse_ptr, acc, l_i, m_i, b, head, split, num_splits, offs_d, h_mask,
                   h_mask[:, None] & d_mask[None, :], GROUP, D)


@triton.jit
def _merge_kernel(mid_o_ptr, mid_lse_ptr, out_ptr, stride_ob, stride_oh, num_splits, H,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, GDC: tl.constexpr,
                  sinks_ptr=None, SINKS: tl.constexpr = False):
    pdl_enter(GDC)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    base = (b * H + h) * num_splits
    lse = tl.load(mid_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    if SINKS:  # the sink is one more term of the denominator, with no value
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # every split empty (seq_len 0): zeros, not NaN
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    o = tl.load(mid_o_ptr + (base + offs_s)[:, None] * D + offs_d[None, :],
                mask=s_mask[:, None] & (offs_d[None, :] < D), other=0.0)
    denominator = tl.sum(w, 0)
    if SINKS:
        denominator += tl.exp2(sink - m)
    res = tl.sum(o * w[:, None], 0) / tl.maximum(denominator, 1e-30)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=offs_d < D)


@functools.cache
def _sm_count(device: torch.device) -> int:
    """Cached: reading the device's properties costs ~15 us of host time per call, and every eager layer asks."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS_FALLBACK


def num_splits_for(batch: int, num_kv_heads: int, max_context: int, sms: int) -> int:
    """Split-K factor: enough programs to fill the GPU, but no split shorter than MIN_SPLIT_TOKENS."""
    want = math.ceil(PROGRAMS_PER_SM * sms / max(1, batch * num_kv_heads))
    cap = max(1, max_context // MIN_SPLIT_TOKENS)
    return max(1, min(want, cap))


def unsplit_from(num_kv_heads: int, device: torch.device) -> int:
    """The smallest batch that runs unsplit at every block-table width (num_splits_for gives 1: its programs
    fill the GPU alone), so its launch differs between widths only in the table's stride and split_tokens, which
    an unsplit program reads only as a bound past seq_len."""
    return -(-PROGRAMS_PER_SM * _sm_count(device) // max(1, num_kv_heads))


@register("decode_attention", "triton")
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int | None = None,
                     order: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     sliding_window: int | None = None, sinks: torch.Tensor | None = None,
                     fresh_rows: int = 1) -> torch.Tensor:
    """`num_splits` overrides the heuristic (tests and tuning). `fresh_rows`: how many of each row's newest
    cache rows the kernels of this step wrote (1 for a decode; a verification's rows see its drafts stored this
    step), which a launch under programmatic dependent launch reads only after waiting for them. A row with seq_len 0 (padding) gets zeros.
    `order` ([B] integers, a permutation of the rows) is the order the programs take the rows in; the result does
    not depend on it. `out`: where to write (reference.attention.attention_out). `k_scale` / `v_scale`: the
    per-kv-head scales of an fp8 cache (kv_fp8.py). `sliding_window`, `sinks`: as the reference's; splits wholly
    before a row's window exit at once (the split count stays the table's)."""
    bsz, h, d = q.shape
    _, block_size, hkv, dk = k_cache.shape
    if dk != d or h % hkv or v_cache.shape != k_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}")
    if block_tables.shape[0] != bsz or seq_lens.shape != (bsz,):
        raise ValueError("decode_attention: block_tables / seq_lens batch size differs from q")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("decode_attention: the head_dim axis must be contiguous")
    if order is not None and (order.shape != (bsz,) or order.dtype.is_floating_point):
        raise ValueError(f"decode_attention: order must be [{bsz}] integers, got {tuple(order.shape)} {order.dtype}")
    if fresh_rows < 1:
        raise ValueError(f"decode_attention: fresh_rows must be at least 1, got {fresh_rows}")
    out = attention_out("decode_attention", q, out)
    if bsz == 0:
        return out
    ks, vs, fp8 = kv_fp8_args(k_cache, v_cache, k_scale, v_scale, "decode_attention")
    group = h // hkv
    max_context = block_tables.shape[1] * block_size
    splits = num_splits or num_splits_for(bsz, hkv, max_context, _sm_count(q.device))
    split_tokens = triton.cdiv(triton.cdiv(max_context, splits), BLOCK_N) * BLOCK_N
    splits = triton.cdiv(max_context, split_tokens)
    direct = splits == 1
    if direct:
        mid_o = mid_lse = out  # unused
    else:
        mid_o = torch.empty(bsz, h, splits, d, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(bsz, h, splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(d)
    block_n = BLOCK_N_UNSPLIT if direct and block_d <= 128 else BLOCK_N
    pdl = pdl_kwargs(q)  # both launches
    order_arg = seq_lens if order is None else order
    if sinks is not None and sinks.shape != (h,):
        raise ValueError(f"decode_attention: sinks {tuple(sinks.shape)} is not [{h}]")
    window = {} if sliding_window is None else {"window": int(sliding_window), "WINDOW": True}
    sink = {} if sinks is None else {"sinks_ptr": sinks, "SINKS": True}
    heads = {"GROUP": group, "BLOCK_H": max(16, triton.next_power_of_2(group)), "D": d, "BLOCK_D": block_d,
             "BLOCK_SIZE": block_size, "ORDERED": order is not None, "UPCAST": INTERPRET, **fp8}
    if not direct and split_tokens == BLOCK_N:
        _decode_tile_kernel[(hkv, bsz, splits)](
            q, k_cache, v_cache, block_tables, seq_lens, order_arg, mid_o, mid_lse, scale * LOG2E, ks, vs,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            block_tables.stride(0), splits, fresh_rows, BLOCK_N=BLOCK_N, **heads, **window, num_warps=NUM_WARPS,
            num_stages=1, **pdl)
    else:
        _decode_kernel[(hkv, bsz, splits)](
            q, k_cache, v_cache, block_tables, seq_lens, order_arg, out, mid_o, mid_lse, scale * LOG2E, ks, vs,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
            split_tokens, splits, BLOCK_N=block_n, DIRECT=direct, **heads, **window, **(sink if direct else {}),
            num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl)
    if not direct:
        _merge_kernel[(bsz, h)](mid_o, mid_lse, out, out.stride(0), out.stride(1), splits, h,
                                D=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
                                **sink, **pdl)
    return out
