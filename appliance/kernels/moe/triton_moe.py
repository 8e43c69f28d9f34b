"""Fused MoE in Triton: tokens sorted by expert and padded to whole BLOCK_M tiles, then two grouped GEMMs.

1. `align_blocks` (torch ops that never sync with the host): the T*K (token, slot) pairs are sorted by expert;
   each expert's run is padded to a multiple of BLOCK_M with a sentinel id, and every BLOCK_M tile gets the
   expert it belongs to (-1 past the end). Buffers are sized for the worst case so the launch shape depends only on T, K and E.
2. `_gate_up_kernel`: per tile, x rows @ w13[e]^T computing the gate and up halves side by side and writing
   silu(gate) * up (the activation is fused: the [T*K, 2I] intermediate never exists).
3. `_down_kernel`: that [T*K, I] activation @ w2[e]^T, times the routing weight, into [T*K, H]; the K slots of
   each token are summed in torch.
fp8 weights are dequantized tile by tile inside both GEMMs (weight-only; activations stay in the model dtype),
with block scales or one scale per output row ([E, N], block_shape None: per-tensor and per-channel checkpoints). gpt-oss adds expert biases to both GEMMs and clamps its SwiGLU (constexpr-guarded: BIAS,
CLAMPED; reference.gated_activation).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from appliance.kernels.moe.triton_fp8 import load_weight_tile, scale_aligned_tiles
from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, mma


@dataclass(frozen=True)
class MoeTiles:
    block_m: int
    block_n: int
    block_k: int
    num_stages: int


PREFILL = MoeTiles(16, 32, 32, 2) if INTERPRET else MoeTiles(64, 64, 64, 3)
# Decode: a few rows per expert. 16-row tiles waste less of each expert's tile on padding, and longer K steps
# through a deeper pipeline stream the expert weights like the dense GEMV (kernels/triton/gemv.py) does.
# Chosen by analogy with that kernel's H100 sweep; not yet timed on the fused MoE itself (docs/benchmarks.md).
DECODE = MoeTiles(16, 16, 64, 2) if INTERPRET else MoeTiles(16, 64, 128, 4)


def tiles_for(pairs: int, num_experts: int) -> MoeTiles:
    """Decode tiles when the routed rows average at most 16 per expert, else the prefill tiles. A function of
    shapes only, so a captured decode graph and an eager step of the same batch use the same tiles."""
    return DECODE if pairs <= 16 * num_experts else PREFILL


def align_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [cap] int32: flat (token*K + slot) indices grouped by expert, sentinel T*K as padding;
    block_experts [cap / block_m] int32: each tile's expert, -1 for tiles past the used length)."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    m = flat.numel()
    cap = m + num_experts * (block_m - 1)
    cap = (cap + block_m - 1) // block_m * block_m
    # scatter_add, not bincount: bincount reads the largest id on the host (a sync a CUDA graph cannot hold)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(m, device=flat.device) - first_of_expert[experts_sorted]
    dest = (ends - padded)[experts_sorted] + rank
    sorted_ids = torch.full((cap,), m, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_start = torch.arange(0, cap, block_m, device=flat.device)
    block_experts = torch.searchsorted(ends, tile_start, right=True).to(torch.int32)
    block_experts = torch.where(tile_start < ends[-1], block_experts, torch.full_like(block_experts, -1))
    return sorted_ids, block_experts


@triton.jit
def gated_activation(acc_g, acc_u, limit, alpha, CLAMPED: tl.constexpr):
    """silu(gate) * up, or gpt-oss's clamped SwiGLU (reference.gated_activation), on float32 tiles."""
    if CLAMPED:
        gate = tl.minimum(acc_g, limit)
        up = tl.minimum(tl.maximum(acc_u, -limit), limit)
        return (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    return acc_g / (1.0 + tl.exp(-acc_g)) * acc_u


@triton.jit
def expert_tile(experts_ptr, ids_ptr, num_pairs, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """A program's tile: the expert of block program_id(0) (int64), the block's (token, expert) pairs and their
    mask, the BLOCK_N output columns of program_id(1) and their mask. A block past the used length has expert -1
    and reads no pairs; its caller returns on it (a jit helper cannot end the kernel)."""
    pid_m = tl.program_id(0)
    e = tl.load(experts_ptr + pid_m).to(tl.int64)
    live = tl.zeros([BLOCK_M], tl.int64) + e >= 0  # a vector: the interpreter takes no scalar mask
    pair = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M), mask=live).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, pair, pair < num_pairs, offs_n, offs_n < n_cols


@triton.jit
def store_gated(acc_g, acc_u, e, pair, m_mask, offs_n, n_mask, inter, out_ptr, stride_om, bias_ptr, limit, alpha,
                BIAS: tl.constexpr, CLAMPED: tl.constexpr):
    """The gate-up GEMM's end: biases (gate then up, [E, 2I]), the gated activation, the store per pair."""
    if BIAS:
        acc_g += tl.load(bias_ptr + e * 2 * inter + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_ptr + e * 2 * inter + inter + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    act = gated_activation(acc_g, acc_u, limit, alpha, CLAMPED)
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], act.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def store_routed(acc, e, pair, m_mask, offs_n, n_mask, hidden, out_ptr, stride_om, weights_ptr, bias_ptr,
                 BIAS: tl.constexpr):
    """The down GEMM's end: the bias ([E, H]), the pair's routing weight, the store per pair."""
    if BIAS:
        acc += tl.load(bias_ptr + e * hidden + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    route = tl.load(weights_ptr + pair, mask=m_mask, other=0.0)
    acc = acc * route[:, None]
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, experts_ptr, num_pairs, inter, hidden,
                    stride_xm, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BN_Q: tl.constexpr, BK_Q: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr,
                    bias_ptr=None, limit=0.0, alpha=1.702, BIAS: tl.constexpr = False, CLAMPED: tl.constexpr = False):
    e, pair, m_mask, offs_n, n_mask = expert_tile(experts_ptr, ids_ptr, num_pairs, inter, BLOCK_M, BLOCK_N)
    if e < 0:  # a block past the used length
        return
    row = pair // TOP_K
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < hidden
        a = tl.load(x_ptr + row[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        g = load_weight_tile(w_ptr, s_ptr, e, offs_n, offs_k, n_mask, k_mask, stride_we, stride_wn, stride_wk,
                             stride_se, stride_sn, stride_sk, k0, BN_Q, BK_Q, FP8)
        u = load_weight_tile(w_ptr, s_ptr, e, offs_n + inter, offs_k, n_mask, k_mask, stride_we, stride_wn, stride_wk,
                             stride_se, stride_sn, stride_sk, k0, BN_Q, BK_Q, FP8)
        acc_g += mma(a, g.to(a.dtype), UPCAST)
        acc_u += mma(a, u.to(a.dtype), UPCAST)
    store_gated(acc_g, acc_u, e, pair, m_mask, offs_n, n_mask, inter, out_ptr, stride_om, bias_ptr, limit, alpha, BIAS,
                CLAMPED)


@triton.jit
def _down_kernel(a_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, experts_ptr, weights_ptr, num_pairs, hidden, inter,
                 stride_am, stride_we, stride_wn, stride_wk, stride_se, stride_sn, stride_sk, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 BN_Q: tl.constexpr, BK_Q: tl.constexpr, FP8: tl.constexpr, UPCAST: tl.constexpr,
                 bias_ptr=None, BIAS: tl.constexpr = False):
    e, pair, m_mask, offs_n, n_mask = expert_tile(experts_ptr, ids_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N)
    if e < 0:  # a block past the used length
        return
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < inter
        a = tl.load(a_ptr + pair[:, None] * stride_am + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = load_weight_tile(w_ptr, s_ptr, e, offs_n, offs_k, n_mask, k_mask, stride_we, stride_wn, stride_wk,
                             stride_se, stride_sn, stride_sk, k0, BN_Q, BK_Q, FP8)
        acc += mma(a, w.to(a.dtype), UPCAST)
    store_routed(acc, e, pair, m_mask, offs_n, n_mask, hidden, out_ptr, stride_om, weights_ptr, bias_ptr, BIAS)


def _scale_args(scale: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    if scale is None:
        return w, 0, 0, 0  # never read (FP8 is off)
    if scale.dim() == 2:  # per-row [E, N]: a k stride of 0 gives every k step the row's one scale
        return scale, scale.stride(0), scale.stride(1), 0
    return scale, scale.stride(0), scale.stride(1), scale.stride(2)


@register("fused_moe", "triton")
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block_shape: tuple[int, int] | None = None, *, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, swiglu_limit: float | None = None,
              swiglu_alpha: float = 1.702) -> torch.Tensor:
    """As the reference's (kernels/moe/reference.py), biases and clamped SwiGLU included."""
    t, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    fp8 = w13_scale is not None
    per_row = fp8 and w13_scale.dim() == 2  # type: ignore[union-attr]
    if fp8 and (w2_scale is None or (block_shape is None) != per_row):
        raise ValueError("fp8 fused_moe needs both scales, and block_shape with block scales (none with per-row "
                         "[E, N] scales)")
    bn_q, bk_q = block_shape if fp8 and not per_row else (1, 1)  # type: ignore[misc]
    pairs = t * top_k
    tiles = tiles_for(pairs, num_experts)
    tile_n, tile_k = (scale_aligned_tiles((bn_q, bk_q), tiles.block_n, tiles.block_k, "Triton fused MoE")
                      if fp8 and not per_row else (tiles.block_n, tiles.block_k))
    x = x.contiguous()
    sorted_ids, block_experts = align_blocks(topk_ids, num_experts, tiles.block_m)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    upcast = INTERPRET or x.dtype == torch.float32
    s13, s13e, s13n, s13k = _scale_args(w13_scale, w13)
    grid = (block_experts.numel(), triton.cdiv(inter, tile_n))
    _gate_up_kernel[grid](x, w13, s13, act, sorted_ids, block_experts, pairs, inter, hidden,
                          x.stride(0), w13.stride(0), w13.stride(1), w13.stride(2), s13e, s13n, s13k, act.stride(0),
                          TOP_K=top_k, BLOCK_M=tiles.block_m, BLOCK_N=tile_n, BLOCK_K=tile_k, BN_Q=bn_q, BK_Q=bk_q,
                          FP8=fp8, UPCAST=upcast, num_stages=tiles.num_stages,
                          **({} if w13_bias is None else {"bias_ptr": w13_bias.contiguous(), "BIAS": True}),
                          **({} if swiglu_limit is None else {"limit": float(swiglu_limit),
                                                              "alpha": float(swiglu_alpha), "CLAMPED": True}))
    out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    s2, s2e, s2n, s2k = _scale_args(w2_scale, w2)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    grid = (block_experts.numel(), triton.cdiv(hidden, tile_n))
    _down_kernel[grid](act, w2, s2, out, sorted_ids, block_experts, weights, pairs, hidden, inter,
                       act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), s2e, s2n, s2k, out.stride(0),
                       BLOCK_M=tiles.block_m, BLOCK_N=tile_n, BLOCK_K=tile_k, BN_Q=bn_q, BK_Q=bk_q, FP8=fp8,
                       UPCAST=upcast, num_stages=tiles.num_stages,
                       **({} if w2_bias is None else {"bias_ptr": w2_bias.contiguous(), "BIAS": True}))
    return out.view(t, top_k, hidden).sum(dim=1).to(x.dtype)
