"""Block-scaled fp8 GEMM in Triton (weight-only): y = x @ (w * scale_inv)^T with each fp8 tile of w scaled as it
is loaded, so the dequantized weight never exists in memory. Used by the dense fp8 layers (layers/fp8.py).

`load_weight_tile` and `scale_aligned_tiles` are the one definition of how a weight tile meets its block scale;
the expert GEMMs in triton_moe.py use them too."""
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


def scale_aligned_tiles(block_shape: tuple[int, int], block_n: int, block_k: int, what: str) -> tuple[int, int]:
    """The (n, k) tile of a GEMM over a block-scaled weight: shrunk to divide the scale blocks, so a tile never
    straddles two scales; ValueError when that leaves a tile under 16 (tl.dot's minimum)."""
    bn, bk = block_shape
    tile_n, tile_k = math.gcd(block_n, bn), math.gcd(block_k, bk)
    if min(tile_n, tile_k) < 16:
        raise ValueError(f"fp8 block {block_shape} is too fine for the {what} (tiles of at least 16)")
    return tile_n, tile_k


@triton.jit
def load_weight_tile(w_ptr, s_ptr, e, offs_n, offs_k, n_mask, k_mask, stride_we, stride_wn, stride_wk,
                     stride_se, stride_sn, stride_sk, k0, BN_Q: tl.constexpr, BK_Q: tl.constexpr, FP8: tl.constexpr):
    """A [BLOCK_K, BLOCK_N] tile of w[e]^T (w is [N, K]); fp8 tiles come back scaled, in float32."""
    w = tl.load(w_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk,
                mask=n_mask[None, :] & k_mask[:, None], other=0.0)
    if FP8:
        s = tl.load(s_ptr + e * stride_se + (offs_n // BN_Q) * stride_sn + (k0 // BK_Q) * stride_sk,
                    mask=n_mask, other=0.0)
        w = w.to(tl.float32) * s[None, :]
    return w


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
        # one weight matrix: expert 0, unit strides along k (weight and scales are contiguous)
        w = load_weight_tile(w_ptr, s_ptr, 0, offs_n, offs_k, n_mask, k_mask, 0, stride_wn, 1, 0, stride_sn, 1, k0,
                             BN_Q, BK_Q, True)
        acc += mma(a, w.to(a.dtype), UPCAST)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@register("fp8_block_matmul", "triton")
def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block_shape: tuple[int, int]) -> torch.Tensor:
    bn, bk = block_shape
    tile_n, tile_k = scale_aligned_tiles(block_shape, BLOCK_N, BLOCK_K, "Triton GEMM")
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
