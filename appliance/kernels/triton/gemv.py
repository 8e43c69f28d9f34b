"""Skinny matmul y = x W^T for decode batches (M <= 16 rows): a weight-streaming GEMV.

At batch 1..16 a decode step's linear layers read every weight byte once and do almost no arithmetic, so their
time is the weight bytes over the memory bandwidth. On the H100 cuBLAS streams Llama-3.1-8B's matrices at
2.0-2.8 TB/s at M = 1; this kernel at 2.4-3.1 TB/s (docs/kernels.md, "GEMV"). One program owns BLOCK_N output
columns and walks K in BLOCK_K tiles with a deep load pipeline; the x rows (padded to 16 for `tl.dot`) are tiny
and stay in L2. `split_k` > 1 cuts K across programs and adds the partial sums with fp32 atomics into a zeroed
buffer: a tuning option for tall-and-narrow weights (few output columns, long K), which never won on the H100
shapes measured so far.

`gemv_rms_norm` is the same kernel with the residual add + RMSNorm that precedes a projection in its prologue
(the NORM switch): at <= 16 rows the input is a few KB, so every program computes each row's inverse RMS in a
pre-pass over K, then builds the normed tiles on the fly while the weights stream; one program also writes the
residual sum. It saves the norm's own launch (and its round trip through memory) per projection. Inputs are
rounded exactly like the rms_norm kernel's output; only the fp32 order of the sum of squares differs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from appliance.kernels.reference.linear import GEMV_MAX_ROWS as MAX_M
from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, mma

PRE_TILE = 2048  # elements per tile of the fused norm's pre-pass (16 fp32 registers a thread at 4 warps)


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 32
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 5
    # programmatic dependent launch (Hopper+): the first weight tile is loaded before waiting for the previous
    # kernel (weights never depend on it) and the next kernel may launch during this one's tail. Off until
    # measured (tools/kernel_lab.py --only chain times it); the interpreter runs the peeled loop without it.
    pdl: bool = False


def config_for(n: int, k: int) -> GemvConfig:
    """Measured on the H100 (tools/kernel_lab.py; docs/kernels.md "GEMV"): one config for the wide and square
    shapes, deeper K tiles for the tall ones (Llama-8B's down projection: 42.2 vs 44.3 us at M = 1)."""
    if INTERPRET:
        return GemvConfig(block_n=16, block_k=32, num_stages=2)
    return GemvConfig(block_k=256) if k > 2 * n else GemvConfig()


@triton.jit
def _sum_tile(x_ptr, res_ptr, rows, offs_k, mask, stride_xm, stride_rm, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual, rounded to the dtype like the rms_norm kernels) for one [BLOCK_M, BLOCK_K] tile."""
    x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows * stride_rm + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _inv_rms(x_ptr, res_ptr, sum_ptr, M, K, stride_xm, stride_rm, stride_sm, eps, sum_rows,
             BLOCK_M: tl.constexpr, PRE_ROWS: tl.constexpr, PRE_K: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """Each row's 1 / rms(x + residual) over the whole K (a few KB, L2-resident), as a [BLOCK_M] vector; the
    residual sum the next layer adds to is stored for the first `sum_rows` rows (all in one program, none in
    the others). Tiles of PRE_ROWS (M rounded up to a power of two) x PRE_K: a batch of one reads a 4096-wide
    row in two steps, not in 32 of the GEMV's 16-row tiles, before its weights start streaming."""
    rows = tl.arange(0, PRE_ROWS)[:, None]
    sq = tl.zeros([PRE_ROWS, PRE_K], tl.float32)
    for k0 in range(0, K, PRE_K):
        offs_k = k0 + tl.arange(0, PRE_K)
        mask = (rows < M) & (offs_k < K)[None, :]
        h = _sum_tile(x_ptr, res_ptr, rows, offs_k, mask, stride_xm, stride_rm, HAS_RESIDUAL)
        if HAS_RESIDUAL:
            tl.store(sum_ptr + rows * stride_sm + offs_k[None, :], h, mask=mask & (rows < sum_rows))
        hf = h.to(tl.float32)
        sq += hf * hf
    inv = tl.rsqrt(tl.sum(sq, 1) / K + eps)  # [PRE_ROWS]
    spread = tl.arange(0, BLOCK_M)[:, None] == tl.arange(0, PRE_ROWS)[None, :]  # onto the GEMV's row tile
    return tl.sum(tl.where(spread, inv[None, :], 0.0), 1)


@triton.jit
def _x_tile(x_ptr, res_ptr, nw_ptr, rows, offs_k, mask, k_mask, stride_xm, stride_rm, inv,
            NORM: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """The GEMV's input tile: x itself, or rms_norm(x + residual) rounded step by step like the rms_norm
    kernel (normalise in fp32, round, times the weight, round), so it equals the unfused path's input."""
    if NORM:
        h = _sum_tile(x_ptr, res_ptr, rows, offs_k, mask, stride_xm, stride_rm, HAS_RESIDUAL)
        normed = (h.to(tl.float32) * inv[:, None]).to(x_ptr.dtype.element_ty).to(tl.float32)
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        return (nw[None, :] * normed).to(x_ptr.dtype.element_ty)
    return tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, res_ptr, nw_ptr, sum_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                 stride_rm, stride_sm, k_per_split, eps,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
                 UPCAST: tl.constexpr, PEEL: tl.constexpr, GDC: tl.constexpr, NORM: tl.constexpr,
                 HAS_RESIDUAL: tl.constexpr, PRE_ROWS: tl.constexpr, PRE_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    rows = offs_m[:, None]
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PEEL:  # first weight tile in flight while the previous kernel finishes (x is its output)
        offs_k0 = k_start + tl.arange(0, BLOCK_K)
        w0 = tl.load(w_rows + offs_k0[None, :], mask=n_mask[:, None] & (offs_k0 < k_end)[None, :], other=0.0)
        if GDC:
            tl.extra.cuda.gdc_wait()
    inv = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        inv = _inv_rms(x_ptr, res_ptr, sum_ptr, M, K, stride_xm, stride_rm, stride_sm, eps,
                       tl.where((pid_n == 0) & (pid_k == 0), M, 0), BLOCK_M, PRE_ROWS, PRE_K, HAS_RESIDUAL)
    if PEEL:
        k_mask = offs_k0 < k_end
        x = _x_tile(x_ptr, res_ptr, nw_ptr, rows, offs_k0, m_mask[:, None] & k_mask[None, :], k_mask, stride_xm,
                    stride_rm, inv, NORM, HAS_RESIDUAL)
        acc += mma(x, tl.trans(w0), UPCAST)
        k_start += BLOCK_K
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        x = _x_tile(x_ptr, res_ptr, nw_ptr, rows, offs_k, m_mask[:, None] & k_mask[None, :], k_mask, stride_xm,
                    stride_rm, inv, NORM, HAS_RESIDUAL)
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += mma(x, tl.trans(w), UPCAST)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    out = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    mask = m_mask[:, None] & n_mask[None, :]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class _Norm:
    """The fused prologue's operands: rms_norm(x + residual) * weight feeds the GEMV."""
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None
    summed: torch.Tensor | None  # where the residual sum goes (residual given)


def _check(x: torch.Tensor, weight: torch.Tensor, op: str) -> torch.Tensor:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1] or x.shape[0] > MAX_M \
            or x.dtype != weight.dtype:
        raise ValueError(f"{op}: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} "
                         f"{weight.dtype} (at most {MAX_M} rows, one dtype)")
    if weight.stride(-1) != 1:
        raise ValueError(f"{op}: the weight's K axis must be contiguous")
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(x: torch.Tensor, weight: torch.Tensor, cfg: GemvConfig, norm: _Norm | None) -> torch.Tensor:
    m, k = x.shape
    n = weight.shape[0]
    k_per = triton.cdiv(triton.cdiv(k, max(1, cfg.split_k)), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per)
    atomic = split > 1
    peel = cfg.pdl and not atomic  # split-K programs share outputs: keep them simple
    gdc = peel and not INTERPRET  # the interpreter has no grid dependency control; it still checks the peel
    y = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic
         else torch.empty(m, n, dtype=x.dtype, device=x.device))
    res = norm.residual if norm is not None and norm.residual is not None else x
    summed = norm.summed if norm is not None and norm.summed is not None else x  # unused without a residual
    pre_rows, pre_k = 1, 16  # the norm's pre-pass tile: PRE_TILE elements, as wide as K (plain GEMV: unused)
    if norm is not None:
        pre_rows = triton.next_power_of_2(max(m, 1))
        pre_k = min(max(PRE_TILE // pre_rows, 16), triton.next_power_of_2(k))
    norm_w, eps = (norm.weight, norm.eps) if norm is not None else (x, 0.0)
    if m and n:
        _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
            x, weight, y, res, norm_w, summed, m, n, k, x.stride(0), weight.stride(0), y.stride(0), res.stride(0),
            summed.stride(0), k_per, eps,
            BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ATOMIC=atomic,
            UPCAST=INTERPRET or x.dtype == torch.float32, PEEL=peel, GDC=gdc, NORM=norm is not None,
            HAS_RESIDUAL=norm is not None and norm.residual is not None, PRE_ROWS=pre_rows, PRE_K=pre_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if gdc else {}))
    return y.to(x.dtype) if atomic else y


@register("gemv", "triton")
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in x's dtype; M <= MAX_M, same dtype for x and weight.
    `config` overrides the measured choice (tuning)."""
    x = _check(x, weight, "gemv")
    y = _launch(x, weight, config or config_for(*weight.shape), None)
    return y + bias if bias is not None else y


@register("gemv_rms_norm", "triton")
def gemv_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, bias: torch.Tensor | None = None, config: GemvConfig | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """rms_norm(x + residual) @ weight^T (+ bias) in one launch, and the residual sum (None without a
    residual): every program normalises the <= 16 input rows itself, one also writes the sum. Same operands as
    `gemv` plus the norm's, all in one dtype."""
    x = _check(x, weight, "gemv_rms_norm")
    k = x.shape[1]
    if norm_weight.shape != (k,) or norm_weight.dtype != x.dtype:
        raise ValueError(f"gemv_rms_norm: norm weight {tuple(norm_weight.shape)} {norm_weight.dtype} does not "
                         f"match x's {k} columns of {x.dtype}")
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"gemv_rms_norm: residual {tuple(residual.shape)} {residual.dtype} differs from x "
                             f"{tuple(x.shape)} {x.dtype}")
        residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    summed = torch.empty_like(x, memory_format=torch.contiguous_format) if residual is not None else None
    norm = _Norm(norm_weight.contiguous(), eps, residual, summed)
    y = _launch(x, weight, config or config_for(*weight.shape), norm)
    return (y + bias if bias is not None else y), summed
