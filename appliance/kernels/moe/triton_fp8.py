"""Block-scaled fp8 GEMM in Triton (weight-only): y = x @ (w * scale_inv)^T with each fp8 tile of w scaled as it
is loaded, so the dequantized weight never exists in memory. Shared by the dense fp8 layers (layers/fp8.py);
the expert GEMMs in triton_moe.py scale their tiles the same way."""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, mma

BLOCK_M = 16 if INTERPRET else 64
BLOCK_N = 32 if INTERPRET else 128
BLOCK_K = 32 if INTERPRET else 128


@triton.jit
def _fp8_gemm_kernel(x_ptr, w_ptr, s_ptr, y_ptr, m, n, k, stride_xm, stride_wn, stride_sn, stride_ym,
                     BN_Q: tl.constexpr, BK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < m, offs_n < n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=n_mask[None, :] & k_mask[:, None],
                    other=0.0)
        s = tl.load(s_ptr + (offs_n // BN_Q) * stride_sn + k0 // BK_Q, mask=n_mask, other=0.0)
        acc += mma(a, (w.to(tl.float32) * s[None, :]).to(a.dtype), UPCAST)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@register("fp8_block_matmul", "triton")
def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block_shape: tuple[int, int]) -> torch.Tensor:
    bn, bk = block_shape
    tile_n, tile_k = math.gcd(BLOCK_N, bn), math.gcd(BLOCK_K, bk)  # a tile never straddles two scales
    if min(tile_n, tile_k) < 16:
        raise ValueError(f"fp8 block {block_shape} is too fine for the Triton GEMM (tiles of at least 16)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    n, k = weight.shape
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(x2.shape[0], BLOCK_M), triton.cdiv(n, tile_n))
    _fp8_gemm_kernel[grid](x2, weight, scale_inv.contiguous(), y, x2.shape[0], n, k, x2.stride(0),
                           weight.stride(0), scale_inv.contiguous().stride(0), y.stride(0), BN_Q=bn, BK_Q=bk,
                           BLOCK_M=BLOCK_M, BLOCK_N=tile_n, BLOCK_K=tile_k,
                           UPCAST=INTERPRET or x.dtype == torch.float32)
    return y.reshape(*lead, n)
