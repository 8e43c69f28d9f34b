"""The decode layer's GEMVs with the small ops between them folded in (batches of at most 16 rows).

A batch-1 decode layer runs ten kernels: RMSNorm, the qkv GEMV, rope + KV store, attention and its split merge,
the o GEMV, residual add + RMSNorm, the gate_up GEMV, SiLU-and-mul, the down GEMV. Folding the small ones into
the GEMVs' epilogues leaves six, and no new work inside a GEMV's weight stream (a fused GEMV that did its norm
math inside the K loop streamed at half speed):

- the o and down GEMVs (`gemv_residual`) add their product to the residual stream and write h * g and each
  program's partial sum of h^2: the producer half of the next RMSNorm (kernels/reference/gemv_chain.py);
- the qkv and gate_up GEMVs read those, stream W (h * g) and scale each row by rsqrt(mean(h^2) + eps) at the end;
- gate_up's programs own gate rows and the up rows of the same columns (rows gathered as they are loaded, the
  weight stays as stored), so the epilogue writes silu(gate) * up;
- qkv's programs own the two halves of 32 rotary pairs of one q or k head (neox layout) or 64 rows of v, so
  the epilogue rotates and writes q, and stores k and v into the paged cache.

The weight stream is gemv.py's: one program per BLOCK_N output rows, y^T = W x^T with the weight tile as the
MMA's left operand, loads pipelined over num_stages, programmatic dependent launch inside captured graphs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.reference.gemv_chain import PAIRS, rope_store_fits
from appliance.kernels.reference.linear import GEMV_MAX_ROWS as MAX_M
from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, pdl_enter, pdl_kwargs
from appliance.kernels.triton.gemv import config_for, weight_stream

_PAIRS = tl.constexpr(PAIRS)  # what the kernels may read of it
BLOCK_M = tl.constexpr(16)  # rows padded to the MMA's narrowest operand


# When a chain kernel lets the next kernel launch under programmatic dependent launch: 0 at its end (the default
# of a kernel that never says), 1 as its programs start, 2 when a program's weight stream is done. The next
# kernel's programs wait (gdc_wait) before reading anything, so any choice is correct; it decides only how early
# they occupy the SMs the running kernel leaves idle.
# Measured on Llama-8B's 32 layers (H100): 0 / 1 / 2 gave 5.202 / 5.143 / 5.156 ms at 1 row,
# 5.720 / 5.716 / 5.664 at 8.
LAUNCH_NEXT = 2
# The qkv kernel at one row lets the decode attention launch as its programs start (its 96 programs leave SMs
# idle for the attention's to wait on): 5.109-5.125 against 5.151-5.158 ms; at 8 rows that lost (5.69 vs 5.64).
QKV_LAUNCH_NEXT_ONE_ROW = 1

def _tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_stages, num_warps): the plain GEMV's measured choice (gemv.config_for); the qkv
    kernel's block_n is fixed by its rotary pairs."""
    cfg = config_for(n, k)
    return cfg.block_n, cfg.block_k, cfg.num_stages, cfg.num_warps


@triton.jit
def _enter(GDC: tl.constexpr, NEXT: tl.constexpr):
    """Under programmatic dependent launch: let the next kernel launch now (NEXT == 1), then wait for the
    previous one before any load of its output."""
    if GDC:
        if NEXT == 1:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def _streamed(GDC: tl.constexpr, NEXT: tl.constexpr):
    """After a program's weight stream: let the next kernel launch now (NEXT == 2)."""
    if GDC:
        if NEXT == 2:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _row_scale(part_ptr, M, P, hidden, eps, BLOCK_P: tl.constexpr):
    """[1, BLOCK_M]: rsqrt(mean(h^2) + eps) per row from the producer's [M, P] partial sums."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_p = tl.arange(0, BLOCK_P)
    s = tl.load(part_ptr + offs_m[None, :] * P + offs_p[:, None],
                mask=(offs_p < P)[:, None] & (offs_m < M)[None, :], other=0.0)
    return tl.rsqrt(tl.sum(s, 0) / hidden + eps)[None, :]


@triton.jit
def _halves(acc, ty, HALF_N: tl.constexpr):
    """acc's first and second BLOCK_N / 2 rows, each rounded to the activation dtype like a GEMM's output."""
    a, b = tl.split(tl.permute(tl.reshape(acc, [2, HALF_N, BLOCK_M]), (1, 2, 0)))
    return a.to(ty).to(tl.float32), b.to(ty).to(tl.float32)


@triton.jit
def _norm_prep_kernel(h_ptr, g_ptr, xs_ptr, part_ptr, N, stride_hm, stride_sm, P, BLOCK_N: tl.constexpr,
                      GDC: tl.constexpr):
    pdl_enter(GDC)
    m = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    offs = p * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < N
    h = tl.load(h_ptr + m * stride_hm + offs, mask=mask, other=0.0)
    hf = h.to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(xs_ptr + m * stride_sm + offs, (hf * g).to(h.dtype), mask=mask)
    tl.store(part_ptr + m * P + p, tl.sum(hf * hf, 0))


@triton.jit
def _residual_kernel(x_ptr, w_ptr, res_ptr, g_ptr, xs_ptr, part_ptr, M, N, K, stride_xm, stride_wn, stride_rm,
                     stride_sm, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREP: tl.constexpr,
                     UPCAST: tl.constexpr, GDC: tl.constexpr, NEXT: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    _enter(GDC, NEXT)
    acc = weight_stream(x_ptr, stride_xm, w_ptr, stride_wn, offs_n, n_mask, M, 0, K, BLOCK_M, BLOCK_N, BLOCK_K,
                        UPCAST)
    _streamed(GDC, NEXT)
    offs_m = tl.arange(0, BLOCK_M)
    mask = n_mask[:, None] & (offs_m < M)[None, :]
    ty = res_ptr.dtype.element_ty
    r_ptrs = res_ptr + offs_m[None, :] * stride_rm + offs_n[:, None]
    h = (acc.to(ty).to(tl.float32) + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(ty)
    tl.store(r_ptrs, h, mask=mask)
    if PREP:
        hf = h.to(tl.float32)
        g = tl.load(g_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(xs_ptr + offs_m[None, :] * stride_sm + offs_n[:, None], (hf * g[:, None]).to(ty), mask=mask)
        tl.store(part_ptr + offs_m * tl.num_programs(0) + pid, tl.sum(hf * hf, 0), mask=offs_m < M)


@triton.jit
def _silu_kernel(x_ptr, w_ptr, part_ptr, out_ptr, M, INTER, K, P, eps, stride_xm, stride_wn, stride_om,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, UPCAST: tl.constexpr,
                 GDC: tl.constexpr, NEXT: tl.constexpr):
    HALF_N: tl.constexpr = BLOCK_N // 2
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK_N)
    col = pid * HALF_N + i % HALF_N
    offs_n = tl.where(i < HALF_N, col, INTER + col)  # gate rows, then the up rows of the same columns
    _enter(GDC, NEXT)
    scale = _row_scale(part_ptr, M, P, K, eps, BLOCK_P)
    acc = weight_stream(x_ptr, stride_xm, w_ptr, stride_wn, offs_n, col < INTER, M, 0, K, BLOCK_M, BLOCK_N, BLOCK_K,
                        UPCAST)
    _streamed(GDC, NEXT)
    gate, up = _halves(acc * scale, out_ptr.dtype.element_ty, HALF_N)
    out = gate / (1.0 + tl.exp(-gate)) * up
    cols = pid * HALF_N + tl.arange(0, HALF_N)
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(out_ptr + offs_m[None, :] * stride_om + cols[:, None], out.to(out_ptr.dtype.element_ty),
             mask=(cols < INTER)[:, None] & (offs_m < M)[None, :])


@triton.jit
def _rope_store_kernel(x_ptr, w_ptr, b_ptr, part_ptr, pos_ptr, cs_ptr, q_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                       M, K, P, eps, stride_xm, stride_wn, stride_c, stride_qm, stride_cb, stride_cs, stride_ch,
                       NQ: tl.constexpr, NKV: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, HAS_BIAS: tl.constexpr,
                       UPCAST: tl.constexpr, GDC: tl.constexpr, NEXT: tl.constexpr):
    HALF: tl.constexpr = D // 2
    BLOCK_N: tl.constexpr = 2 * _PAIRS
    PER_HEAD: tl.constexpr = HALF // _PAIRS
    ROPE_PROGRAMS: tl.constexpr = (NQ + NKV) * PER_HEAD
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK_N)
    head = pid // PER_HEAD
    j0 = (pid % PER_HEAD) * _PAIRS
    rows_rope = head * D + tl.where(i < _PAIRS, j0 + i, HALF + j0 + i - _PAIRS)
    rows_v = (NQ + NKV) * D + (pid - ROPE_PROGRAMS) * BLOCK_N + i
    offs_n = tl.where(pid < ROPE_PROGRAMS, rows_rope, rows_v)
    _enter(GDC, NEXT)
    scale = _row_scale(part_ptr, M, P, K, eps, BLOCK_P)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    slot = tl.load(slot_ptr + offs_m, mask=m_mask, other=-1).to(tl.int64)
    slot_off = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs)[None, :]
    store = (m_mask & (slot >= 0))[None, :]
    acc = weight_stream(x_ptr, stride_xm, w_ptr, stride_wn, offs_n, offs_n >= 0, M, 0, K, BLOCK_M, BLOCK_N, BLOCK_K,
                        UPCAST)
    _streamed(GDC, NEXT)
    acc = acc * scale
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n).to(tl.float32)[:, None]
    ty = q_ptr.dtype.element_ty
    cache_ty = k_cache_ptr.dtype.element_ty
    if pid < ROPE_PROGRAMS:
        x1, x2 = _halves(acc, ty, _PAIRS)
        pos = tl.load(pos_ptr + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_j = (j0 + tl.arange(0, _PAIRS))[:, None]
        cos = tl.load(cs_ptr + pos[None, :] * stride_c + offs_j).to(tl.float32)
        sin = tl.load(cs_ptr + pos[None, :] * stride_c + HALF + offs_j).to(tl.float32)
        y1 = (x1 * cos - x2 * sin).to(ty)
        y2 = (x2 * cos + x1 * sin).to(ty)
        if head < NQ:
            q_dst = q_ptr + offs_m[None, :] * stride_qm + head * D + offs_j
            tl.store(q_dst, y1, mask=m_mask[None, :])
            tl.store(q_dst + HALF, y2, mask=m_mask[None, :])
        else:
            k_dst = k_cache_ptr + slot_off + (head - NQ) * stride_ch + offs_j
            tl.store(k_dst, y1.to(cache_ty), mask=store)
            tl.store(k_dst + HALF, y2.to(cache_ty), mask=store)
    else:
        v_row = (pid - ROPE_PROGRAMS) * BLOCK_N + i
        v_dst = v_cache_ptr + slot_off + ((v_row // D) * stride_ch + v_row % D)[:, None]
        tl.store(v_dst, acc.to(ty).to(cache_ty), mask=store)


def _check(name: str, x: torch.Tensor, weight: torch.Tensor, partials: torch.Tensor | None = None) -> None:
    m, k = x.shape if x.dim() == 2 else (0, -1)
    if x.dim() != 2 or weight.shape[1] != k or not 0 < m <= MAX_M or x.dtype != weight.dtype:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} "
                         f"{weight.dtype} (1 to {MAX_M} rows, one dtype)")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"{name}: the K axis of x and weight must be contiguous")
    if partials is not None and (partials.dim() != 2 or partials.shape[0] != m or not partials.is_contiguous()
                                 or partials.dtype != torch.float32):
        raise ValueError(f"{name}: partials {tuple(partials.shape)} {partials.dtype} are not contiguous float32 "
                         f"[{m}, P]")


@register("norm_prep", "triton")
def norm_prep(h: torch.Tensor, norm_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    m, n = h.shape
    block = min(1024, triton.next_power_of_2(n))
    parts = triton.cdiv(n, block)
    xs = torch.empty_like(h)
    partials = torch.empty(m, parts, dtype=torch.float32, device=h.device)
    _norm_prep_kernel[(m, parts)](h, norm_weight, xs, partials, n, h.stride(0), xs.stride(0), parts, BLOCK_N=block,
                                  num_warps=4, **pdl_kwargs(h))
    return xs, partials


@register("gemv_residual", "triton")
def gemv_residual(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                  norm_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    _check("gemv_residual", x, weight)
    m, k = x.shape
    n = weight.shape[0]
    if residual.shape != (m, n) or residual.stride(-1) != 1:
        raise ValueError(f"gemv_residual: residual {tuple(residual.shape)} is not a contiguous-row [{m}, {n}]")
    block_n, block_k, stages, warps = _tiles(n, k)
    grid = triton.cdiv(n, block_n)
    prep = norm_weight is not None
    xs = torch.empty_like(residual) if prep else residual
    partials = torch.empty(m, grid, dtype=torch.float32, device=x.device) if prep else residual
    _residual_kernel[(grid,)](x, weight, residual, norm_weight if prep else residual, xs, partials, m, n, k,
                              x.stride(0), weight.stride(0), residual.stride(0), xs.stride(0), BLOCK_N=block_n,
                              BLOCK_K=block_k, PREP=prep, UPCAST=INTERPRET, num_warps=warps, num_stages=stages,
                              NEXT=LAUNCH_NEXT, **pdl_kwargs(x))
    return (xs, partials) if prep else None


@register("gemv_normed_silu", "triton")
def gemv_normed_silu(xs: torch.Tensor, weight: torch.Tensor, partials: torch.Tensor, eps: float) -> torch.Tensor:
    _check("gemv_normed_silu", xs, weight, partials)
    m, k = xs.shape
    inter = weight.shape[0] // 2
    block_n, block_k, stages, warps = _tiles(weight.shape[0], k)
    out = torch.empty(m, inter, dtype=xs.dtype, device=xs.device)
    p = partials.shape[1]
    grid = triton.cdiv(inter, block_n // 2)
    _silu_kernel[(grid,)](
        xs, weight, partials, out, m, inter, k, p, eps, xs.stride(0), weight.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_P=triton.next_power_of_2(p), UPCAST=INTERPRET, num_warps=warps,
        num_stages=stages, NEXT=LAUNCH_NEXT, **pdl_kwargs(xs))
    return out


@register("gemv_normed_rope_store", "triton")
def gemv_normed_rope_store(xs: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           partials: torch.Tensor, eps: float, positions: torch.Tensor, num_heads: int,
                           num_kv_heads: int, head_dim: int, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    _check("gemv_normed_rope_store", xs, weight, partials)
    if not rope_store_fits(head_dim, cos_sin_cache.shape[-1], True, False):
        raise ValueError(f"gemv_normed_rope_store: head_dim {head_dim} with a rotary width of "
                         f"{cos_sin_cache.shape[-1]} is not served (whole-head neox rotary, half a multiple of "
                         f"{PAIRS})")
    if weight.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim or k_cache.stride() != v_cache.stride():
        raise ValueError(f"gemv_normed_rope_store: weight {tuple(weight.shape)} or the caches do not fit "
                         f"{num_heads} + 2 x {num_kv_heads} heads of {head_dim}")
    m, k = xs.shape
    q = torch.empty(m, num_heads, head_dim, dtype=xs.dtype, device=xs.device)
    programs = (num_heads + num_kv_heads) * (head_dim // 2 // PAIRS) + num_kv_heads * head_dim // (2 * PAIRS)
    p = partials.shape[1]
    _, block_k, stages, warps = _tiles(weight.shape[0], k)
    _rope_store_kernel[(programs,)](
        xs, weight, bias if bias is not None else xs, partials, positions, cos_sin_cache, q, k_cache, v_cache,
        slot_mapping, m, k, p, eps, xs.stride(0), weight.stride(0), cos_sin_cache.stride(0), q.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NQ=num_heads, NKV=num_kv_heads, D=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_K=block_k,
        BLOCK_P=triton.next_power_of_2(p), HAS_BIAS=bias is not None, UPCAST=INTERPRET, num_warps=warps,
        num_stages=stages, NEXT=QKV_LAUNCH_NEXT_ONE_ROW if m == 1 else LAUNCH_NEXT, **pdl_kwargs(xs))
    return q
