"""The fused MoE over MXFP4 expert weights (op "fused_moe_mxfp4"): 16-bit activations x e2m1 weights, dequantized
tile by tile in registers, 16-bit MMA with float32 accumulation. The experts stay in memory as the checkpoint
ships them (kernels/mxfp4.py: 4.25 bits a weight), so a decode step reads about a quarter of the bytes of the
dequantized stack.

    fused_moe_mxfp4(x[T,H], w13_blocks[E,2I,H/2] u8, w13_scales[E,2I,H/32] u8, w2_blocks[E,H,I/2] u8,
                    w2_scales[E,H,I/32] u8, topk_weights[T,K] f32, topk_ids[T,K], *, w13_bias=None, w2_bias=None,
                    swiglu_limit=None, swiglu_alpha=1.702) -> [T,H]

The shape of triton_moe.py: the same expert sort and tile alignment (`align_blocks`, `tiles_for`), a gate/up GEMM
with the activation fused, a down GEMM times the routing weight. A K step of BLOCK_K walks its 32-value scale
groups (BLOCK_K divides K, so no step is partial): each group's scale is one value per output column, and its
bytes hold columns 2j (low nibble) and 2j + 1 (high nibble), so the activation tile's even and odd columns meet
the low and high nibbles in two dots of K = 16 (tl.dot's least): the interleaved weight tile is never built.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from appliance.kernels.moe.triton_moe import align_blocks, gated_activation, tiles_for
from appliance.kernels.mxfp4 import BLOCK
from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, mma


@triton.jit
def e2m1_tiny(code):
    """e2m1 codes (int32, the low 4 bits: sign, 2 exponent bits with bias 1, 1 mantissa bit) -> value * 2^-14 in
    float32. Moved into a half's exponent and mantissa fields the code is that half exactly (codes of exponent 0
    land on the half's subnormals, 0 and 0.5 * 2^-14), and half -> float32 is exact: a few bit operations and one
    conversion a weight, where decoding sign, exponent and mantissa arithmetically takes about fifteen (at batch 1
    the dequantization runs once per weight read, so its cost sits beside the memory time)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def mxfp4_group(b_ptr, s_ptr, e, offs_n, n_mask, group, stride_be, stride_bn, stride_se, stride_sn,
                dtype: tl.constexpr):
    """One 32-value scale group of w[e]^T for the output columns offs_n, dequantized to `dtype`: the [16, BLOCK_N]
    tiles of its even and odd k (byte j holds k = 2j in its low nibble, 2j + 1 in its high one)."""
    offs_j = group * 16 + tl.arange(0, 16)
    byte = tl.load(b_ptr + e * stride_be + offs_n[None, :] * stride_bn + offs_j[:, None], mask=n_mask[None, :],
                   other=0).to(tl.int32)
    biased = tl.load(s_ptr + e * stride_se + offs_n * stride_sn + group, mask=n_mask, other=0).to(tl.int32)
    # 2^(s - 127) * 2^14 (e2m1_tiny's 2^-14 undone) as float32 bits; exact for every scale up to 2^113
    scale = ((biased + 14) << 23).to(tl.float32, bitcast=True)[None, :]
    return (e2m1_tiny(byte) * scale).to(dtype), (e2m1_tiny(byte >> 4) * scale).to(dtype)


@triton.jit
def _gate_up_kernel(x_ptr, b_ptr, s_ptr, out_ptr, ids_ptr, experts_ptr, num_pairs, inter, hidden,
                    stride_xm, stride_be, stride_bn, stride_se, stride_sn, stride_om,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    UPCAST: tl.constexpr, bias_ptr=None, limit=0.0, alpha=1.702, BIAS: tl.constexpr = False,
                    CLAMPED: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    pair = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = pair < num_pairs
    row = pair // TOP_K
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dtype = x_ptr.dtype.element_ty
    for k0 in range(0, hidden, BLOCK_K):  # BLOCK_K divides hidden: no step is partial
        for sub in tl.static_range(BLOCK_K // 32):
            group = k0 // 32 + sub
            a_ptrs = x_ptr + row[:, None] * stride_xm + group * 32 + 2 * tl.arange(0, 16)[None, :]  # even columns
            a_even = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            a_odd = tl.load(a_ptrs + 1, mask=m_mask[:, None], other=0.0)
            g_even, g_odd = mxfp4_group(b_ptr, s_ptr, e, offs_n, n_mask, group, stride_be, stride_bn, stride_se,
                                        stride_sn, dtype)
            u_even, u_odd = mxfp4_group(b_ptr, s_ptr, e, offs_n + inter, n_mask, group, stride_be, stride_bn,
                                        stride_se, stride_sn, dtype)
            acc_g += mma(a_even, g_even, UPCAST) + mma(a_odd, g_odd, UPCAST)
            acc_u += mma(a_even, u_even, UPCAST) + mma(a_odd, u_odd, UPCAST)
    if BIAS:  # [E, 2I]: gate biases, then up biases
        acc_g += tl.load(bias_ptr + e * 2 * inter + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bias_ptr + e * 2 * inter + inter + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    act = gated_activation(acc_g, acc_u, limit, alpha, CLAMPED)
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], act.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(a_ptr, b_ptr, s_ptr, out_ptr, ids_ptr, experts_ptr, weights_ptr, num_pairs, hidden, inter,
                 stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr,
                 bias_ptr=None, BIAS: tl.constexpr = False):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e < 0:
        return
    e = e.to(tl.int64)
    pair = tl.load(ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    m_mask = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    dtype = a_ptr.dtype.element_ty
    for k0 in range(0, inter, BLOCK_K):  # BLOCK_K divides inter
        for sub in tl.static_range(BLOCK_K // 32):
            group = k0 // 32 + sub
            a_ptrs = a_ptr + pair[:, None] * stride_am + group * 32 + 2 * tl.arange(0, 16)[None, :]
            a_even = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            a_odd = tl.load(a_ptrs + 1, mask=m_mask[:, None], other=0.0)
            w_even, w_odd = mxfp4_group(b_ptr, s_ptr, e, offs_n, n_mask, group, stride_be, stride_bn, stride_se,
                                        stride_sn, dtype)
            acc += mma(a_even, w_even, UPCAST) + mma(a_odd, w_odd, UPCAST)
    if BIAS:  # [E, H]
        acc += tl.load(bias_ptr + e * hidden + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    route = tl.load(weights_ptr + pair, mask=m_mask, other=0.0)
    acc = acc * route[:, None]
    tl.store(out_ptr + pair[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def check_shapes(x: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                 w2_scales: torch.Tensor) -> tuple[int, int, int]:
    """(experts, hidden, intermediate) of an MXFP4 expert stack; ValueError when the tensors disagree."""
    e, two_inter, half_hidden = w13_blocks.shape
    inter, hidden = two_inter // 2, x.shape[1]
    want = {"w13_blocks": (w13_blocks, (e, 2 * inter, hidden // 2)),
            "w13_scales": (w13_scales, (e, 2 * inter, hidden // BLOCK)),
            "w2_blocks": (w2_blocks, (e, hidden, inter // 2)), "w2_scales": (w2_scales, (e, hidden, inter // BLOCK))}
    for name, (t, shape) in want.items():
        if t.dtype != torch.uint8 or tuple(t.shape) != shape or t.stride(-1) != 1:
            raise ValueError(f"fused_moe_mxfp4: {name} is {t.dtype} {tuple(t.shape)} (strides {t.stride()}), "
                             f"expected uint8 {shape} with unit last stride for hidden {hidden} and intermediate "
                             f"{inter}")
    if hidden % BLOCK or inter % BLOCK or half_hidden * 2 != hidden:
        raise ValueError(f"fused_moe_mxfp4: hidden {hidden} and intermediate {inter} must be multiples of {BLOCK}")
    return e, hidden, inter


def whole_steps(k: int, block_k: int) -> int:
    """The K step for a reduction of k (whole 32-value groups): the largest number of groups that divides both
    block_k's and k's, so every step is whole and no load needs a K mask (2880 = 90 groups: 64 for a 128 tile)."""
    return BLOCK * math.gcd(k // BLOCK, max(1, block_k // BLOCK))


@register("fused_moe_mxfp4", "triton")
def fused_moe_mxfp4(x: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                    w2_scales: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> torch.Tensor:
    """As the reference's (kernels/moe/reference.py), biases and clamped SwiGLU included."""
    num_experts, hidden, inter = check_shapes(x, w13_blocks, w13_scales, w2_blocks, w2_scales)
    t, top_k = topk_ids.shape
    pairs = t * top_k
    tiles = tiles_for(pairs, num_experts)
    x = x.contiguous()
    sorted_ids, block_experts = align_blocks(topk_ids, num_experts, tiles.block_m)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    upcast = INTERPRET or x.dtype == torch.float32
    grid = (block_experts.numel(), triton.cdiv(inter, tiles.block_n))
    _gate_up_kernel[grid](x, w13_blocks, w13_scales, act, sorted_ids, block_experts, pairs, inter, hidden,
                          x.stride(0), w13_blocks.stride(0), w13_blocks.stride(1), w13_scales.stride(0),
                          w13_scales.stride(1), act.stride(0), TOP_K=top_k, BLOCK_M=tiles.block_m,
                          BLOCK_N=tiles.block_n, BLOCK_K=whole_steps(hidden, tiles.block_k), UPCAST=upcast,
                          num_stages=tiles.num_stages,
                          **({} if w13_bias is None else {"bias_ptr": w13_bias.contiguous(), "BIAS": True}),
                          **({} if swiglu_limit is None else {"limit": float(swiglu_limit),
                                                              "alpha": float(swiglu_alpha), "CLAMPED": True}))
    out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    grid = (block_experts.numel(), triton.cdiv(hidden, tiles.block_n))
    _down_kernel[grid](act, w2_blocks, w2_scales, out, sorted_ids, block_experts, weights, pairs, hidden, inter,
                       act.stride(0), w2_blocks.stride(0), w2_blocks.stride(1), w2_scales.stride(0),
                       w2_scales.stride(1), out.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                       BLOCK_K=whole_steps(inter, tiles.block_k), UPCAST=upcast, num_stages=tiles.num_stages,
                       **({} if w2_bias is None else {"bias_ptr": w2_bias.contiguous(), "BIAS": True}))
    return out.view(t, top_k, hidden).sum(dim=1).to(x.dtype)
