"""Skinny matmul y = x W^T for decode batches (M <= 16 rows): a weight-streaming GEMV.

At batch 1..16 a decode step's linear layers read every weight byte once and do almost no arithmetic, so their
time is the weight bytes over the memory bandwidth. On the H100 cuBLAS streams Llama-3.1-8B's matrices at
2.0-2.8 TB/s at M = 1; this kernel at 2.3-3.1 TB/s (docs/kernels.md, "GEMV"). One program owns BLOCK_N output
columns and walks K in BLOCK_K tiles with a deep load pipeline, computing y^T = W x^T so that the weight tile
feeds the MMA as stored (64 rows: a warpgroup MMA); the x rows (padded to 16 for `tl.dot`) are tiny and stay
in L2. `split_k` > 1 cuts K across programs and adds the partial sums with fp32 atomics into a zeroed
buffer: a tuning option for tall-and-narrow weights (few output columns, long K), which never won on the H100
shapes measured so far.

Inside captured decode graphs the kernel is launched with programmatic dependent launch (common.py): its
programs start while the kernel before (a norm, the attention merge, SiLU-and-mul) still runs and wait for it
before reading x. Tried and dropped: asking L2 for the first 8 / 24 MB of the weight before that wait (the
batch-1 graph took 5.53 / 5.68 ms against 5.46 without), loading one weight tile before the wait in a
chain of GEMVs only, fusing the RMSNorm, SiLU-and-mul and residual add into these GEMVs (streamed at half speed),
prefetching the next GEMV's weight from this one's programs, where it competes with this one's stream.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from appliance.kernels.reference.linear import GEMV_MAX_ROWS as MAX_M
from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, mma, pdl_kwargs


@dataclass(frozen=True)
class GemvConfig:
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 6


def config_for(n: int, k: int) -> GemvConfig:
    """Measured on an H100 (docs/kernels.md "GEMV"): 64 output rows per program (one
    warpgroup MMA) for the wide and square shapes, 32 rows and deeper K tiles for the tall ones (Llama-8B's down
    projection: 41.9 vs 42.9 us at M = 1)."""
    if INTERPRET:
        return GemvConfig(block_n=16, block_k=32, num_stages=2)
    return GemvConfig(block_n=32, block_k=256) if k > 2 * n else GemvConfig()


@triton.jit
def weight_stream(x_ptr, stride_xm, w_ptr, stride_wn, offs_n, n_mask, M, k_start, k_end, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] float32 = W[offs_n, k_start:k_end] x[:, k_start:k_end]^T: y^T = W x^T, so the weight
    tile is the MMA's left operand as stored (no transpose on the way in). Shared with gemv_chain.py."""
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_end
        w = tl.load(w_rows + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None], mask=m_mask[None, :] & k_mask[:, None],
                    other=0.0)
        acc += mma(w, x, UPCAST)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ATOMIC: tl.constexpr,
                 UPCAST: tl.constexpr, GDC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if GDC:  # launched early: x is the kernel before's output
        tl.extra.cuda.gdc_wait()
    k_start = pid_k * k_per_split
    acc = weight_stream(x_ptr, stride_xm, w_ptr, stride_wn, offs_n, n_mask, M, k_start,
                        tl.minimum(k_start + k_per_split, K), BLOCK_M, BLOCK_N, BLOCK_K, UPCAST)
    out = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    mask = m_mask[None, :] & n_mask[:, None]
    if ATOMIC:
        tl.atomic_add(out, acc, mask=mask)
    else:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=mask)


@register("gemv", "triton")
def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T (+ bias) -> [M, N] in x's dtype; M <= MAX_M, same dtype for x and weight.
    `config` overrides the measured choice (tuning)."""
    m, k = x.shape if x.dim() == 2 else (0, -1)
    if x.dim() != 2 or weight.shape[1] != k or m > MAX_M or x.dtype != weight.dtype:
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} "
                         f"{weight.dtype} (at most {MAX_M} rows, one dtype)")
    if weight.stride(-1) != 1:
        raise ValueError("gemv: the weight's K axis must be contiguous")
    x = x if x.stride(-1) == 1 else x.contiguous()
    n = weight.shape[0]
    cfg = config or config_for(n, k)
    k_per = triton.cdiv(triton.cdiv(k, max(1, cfg.split_k)), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per)
    atomic = split > 1
    y = (torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic
         else torch.empty(m, n, dtype=x.dtype, device=x.device))
    pdl = {"GDC": False} if atomic else pdl_kwargs(x)  # split-K (a tuning option) keeps the plain launch
    if m and n:
        _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
            x, weight, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0), k_per,
            BLOCK_M=16, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ATOMIC=atomic,
            UPCAST=INTERPRET or x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **pdl)
    y = y.to(x.dtype) if atomic else y
    return y + bias if bias is not None else y
