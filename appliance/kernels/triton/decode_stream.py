"""Paged decode attention with the KV tiles of the whole batch dealt out evenly to a fixed set of programs.

The registered kernel (decode.py) gives each program one (sequence, kv head) pair, or one of its equal splits: on
a ragged batch the programs differ in length, and each one starts its load pipeline cold. Here every (sequence,
kv head) pair is cut into BLOCK_N-token tiles, the tiles of the batch are laid end to end (sequence by sequence,
kv head by kv head) and program p walks tiles [p T / P, (p + 1) T / P) in one loop, so the pipeline stays full
from one pair to the next and every program reads the same number of tiles. The number of programs P is fixed
on the host (CUDA-graph safe); T is computed by every program from seq_lens. A pair whose tiles all fall in one
program is finished there; a pair cut between programs leaves normalised partial results (one slot for a
program's first pair, one for its last), which a second pass merges by their log-sum-exp.

Not wired into the runner: tools/kernel_lab.py (`--only decode_stream`) times it against the registered kernel;
it replaces the split path only if the H100 says so (docs/kernels.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.triton.common import (
    INTERPRET,
    LOG2E,
    paged_kv_tile,
    softmax_step,
)
from appliance.kernels.triton.decode import check_inputs, sm_count

BLOCK_N = 64
PROGRAMS_PER_SM = 2
NUM_WARPS = 4
NUM_STAGES = 3


@triton.jit
def _tile_of(t, ntiles, offs_b, cum_incl, HKV):
    """The sequence b, kv head, tile within the pair, tiles in the pair, and the pair's first tile, of tile t."""
    b = tl.sum((cum_incl <= t).to(tl.int32), 0)
    first_of_seq = tl.sum(tl.where(offs_b < b, ntiles, 0), 0) * HKV
    n_b = tl.sum(tl.where(offs_b == b, ntiles, 0), 0)
    local = t - first_of_seq
    kvh = local // n_b
    return b, kvh, local % n_b, n_b, first_of_seq + kvh * n_b


@triton.jit
def _stream_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, qk_scale,
                   stride_qb, stride_qh, stride_ob, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt, B, HKV,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, UPCAST: tl.constexpr):
    p = tl.program_id(0)
    num_p = tl.num_programs(0)
    offs_b = tl.arange(0, BLOCK_B)
    lens = tl.load(lens_ptr + offs_b, mask=offs_b < B, other=0)
    ntiles = (lens + BLOCK_N - 1) // BLOCK_N
    cum_incl = tl.cumsum(ntiles, 0) * HKV
    total = tl.sum(ntiles, 0) * HKV
    start = (p * total) // num_p
    end = ((p + 1) * total) // num_p

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < D
    hd_mask = h_mask[:, None] & d_mask[None, :]
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for t in range(start, end):
        b, kvh, tile, n_b, pair_first = _tile_of(t, ntiles, offs_b, cum_incl, HKV)
        fresh = (tile == 0) | (t == start)  # a new pair starts here: reset the running softmax
        m_i = tl.where(fresh, float("-inf"), m_i)
        l_i = tl.where(fresh, 0.0, l_i)
        acc = tl.where(fresh, 0.0, acc)
        head = kvh * GROUP + offs_h
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :], mask=hd_mask, other=0.0)
        seq_len = tl.load(lens_ptr + b)
        pos = tile * BLOCK_N + offs_n
        n_mask = pos < seq_len
        k, v = paged_kv_tile(k_ptr, v_ptr, bt_ptr + b * stride_bt, pos, n_mask, kvh, stride_cb, stride_cs, stride_ch,
                             offs_d, d_mask, PAGE)
        m_i, l_i, acc = softmax_step(q, k, v, n_mask, m_i, l_i, acc, qk_scale, UPCAST)
        # the pair's last tile here, or this program's last tile: finish the pair, or leave a partial
        # (flags as int32 multiplied into the masks: the interpreter turns bool tensor & bool scalar into int32)
        closing = ((tile == n_b - 1) | (t == end - 1)).to(tl.int32)
        whole = ((tile == n_b - 1) & (pair_first >= start)).to(tl.int32)
        o = acc / tl.maximum(l_i, 1e-30)[:, None]
        tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=hd_mask.to(tl.int32) * (closing * whole) != 0)
        slot = p * 2 + (pair_first >= start).to(tl.int32)  # 0: the pair began before this program, 1: in it
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.maximum(l_i, 1e-30)), float("-inf"))
        partial = closing * (1 - whole)
        tl.store(part_o_ptr + (slot * BLOCK_H + offs_h)[:, None] * D + offs_d[None, :], o,
                 mask=hd_mask.to(tl.int32) * partial != 0)
        tl.store(part_lse_ptr + slot * BLOCK_H + offs_h, lse, mask=h_mask.to(tl.int32) * partial != 0)


@triton.jit
def _stream_merge_kernel(lens_ptr, out_ptr, part_o_ptr, part_lse_ptr, stride_ob, stride_oh, B, HKV, num_p,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """Per (sequence, q head): the pairs cut between programs, merged from their slots; empty rows get zeros."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // GROUP
    g = h % GROUP
    offs_b = tl.arange(0, BLOCK_B)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    lens = tl.load(lens_ptr + offs_b, mask=offs_b < B, other=0)
    ntiles = (lens + BLOCK_N - 1) // BLOCK_N
    total = tl.sum(ntiles, 0) * HKV
    n_b = tl.sum(tl.where(offs_b == b, ntiles, 0), 0)
    first = tl.sum(tl.where(offs_b < b, ntiles, 0), 0) * HKV + kvh * n_b
    dst = out_ptr + b * stride_ob + h * stride_oh + offs_d
    if n_b == 0:
        tl.store(dst, tl.zeros([BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty), mask=d_mask)
    else:
        # program of tile x: the p with p T / P <= x < (p + 1) T / P
        p_lo = ((first + 1) * num_p - 1) // total
        p_hi = ((first + n_b) * num_p - 1) // total
        if p_lo != p_hi:
            m = tl.full([], float("-inf"), tl.float32)
            w_sum = tl.zeros([], tl.float32)
            acc = tl.zeros([BLOCK_D], tl.float32)
            for q in range(p_lo, p_hi + 1):
                q_start = (q * total) // num_p
                filled = (q_start < ((q + 1) * total) // num_p).to(tl.int32)  # programs with no tiles wrote none
                slot = q * 2 + (q_start <= first).to(tl.int32)  # only p_lo holds the pair's first tile
                lse = tl.load(part_lse_ptr + slot * BLOCK_H + g, mask=filled != 0, other=float("-inf"))
                o = tl.load(part_o_ptr + (slot * BLOCK_H + g) * D + offs_d, mask=d_mask.to(tl.int32) * filled != 0,
                            other=0.0)
                m_new = tl.maximum(m, lse)
                scale_old = tl.where(m_new == float("-inf"), 0.0, tl.exp2(m - m_new))
                w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - m_new))
                acc = acc * scale_old + o * w
                w_sum = w_sum * scale_old + w
                m = m_new
            tl.store(dst, (acc / tl.maximum(w_sum, 1e-30)).to(out_ptr.dtype.element_ty), mask=d_mask)


def stream_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                            programs: int | None = None, block_n: int = BLOCK_N) -> torch.Tensor:
    """decode_attention's contract (q [B, H, D], caches [blocks, page, Hkv, D], tables [B, W], seq_lens [B]);
    `programs` overrides the count (tests: a few programs cut most pairs) and `block_n` the tile length (tuning).
    A row with seq_len 0 gets zeros."""
    bsz, h, hkv, d, page = check_inputs("stream_decode_attention", q, k_cache, v_cache, block_tables, seq_lens)
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    group = h // hkv
    block_h = max(16, triton.next_power_of_2(group))
    num_p = programs or PROGRAMS_PER_SM * sm_count(q.device)
    part_o = torch.empty(num_p * 2 * block_h, d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_p * 2 * block_h, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(d)
    block_b = max(16, triton.next_power_of_2(bsz))
    _stream_kernel[(num_p,)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0), bsz, hkv,
        GROUP=group, BLOCK_H=block_h, D=d, BLOCK_D=block_d, PAGE=page, BLOCK_N=block_n, BLOCK_B=block_b,
        UPCAST=INTERPRET, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _stream_merge_kernel[(bsz, h)](seq_lens, out, part_o, part_lse, out.stride(0), out.stride(1), bsz, hkv, num_p,
                                   GROUP=group, BLOCK_H=block_h, D=d, BLOCK_D=block_d, BLOCK_N=block_n,
                                   BLOCK_B=block_b, num_warps=4)
    return out
