"""The fused MoE over MXFP4 expert weights (op "fused_moe_mxfp4"): 16-bit activations x e2m1 weights, dequantized
tile by tile in registers, 16-bit MMA with float32 accumulation. The experts stay in memory as the checkpoint
ships them (kernels/mxfp4.py: 4.25 bits a weight), so a decode step reads about a quarter of the bytes of the
dequantized stack.

    fused_moe_mxfp4(x[T,H], w13_blocks[E,2I,H/2] u8, w13_scales[E,2I,H/32] u8, w2_blocks[E,H,I/2] u8,
                    w2_scales[E,H,I/32] u8, topk_weights[T,K] f32, topk_ids[T,K], *, w13_bias=None, w2_bias=None,
                    swiglu_limit=None, swiglu_alpha=1.702) -> [T,H]

The shape of triton_moe.py: the same expert sort and tile alignment (`align_blocks`, `tiles_for`), a gate/up GEMM
with the activation fused, a down GEMM times the routing weight. A byte holds the weights of columns 2j (low
nibble) and 2j + 1 (high nibble), so each K step takes the activation tile's even and odd columns and meets them
with the low and high nibbles in two dots of BLOCK_K / 2: the interleaved weight tile is never built.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from appliance.kernels.moe.triton_moe import align_blocks, gated_activation, tiles_for
from appliance.kernels.mxfp4 import BLOCK
from appliance.kernels.registry import register
from appliance.kernels.triton.common import INTERPRET, mma


@triton.jit
def e2m1_value(code):
    """e2m1 codes (int32 0..15: bit 3 the sign, bits 2-1 the exponent with bias 1, bit 0 the mantissa) -> float32."""
    magnitude = code & 7
    exponent = magnitude >> 1
    mantissa = magnitude & 1
    # a normal value 2^(e - 1) * (1 + m / 2) written as float32 bits; exponent 0 is the subnormal m / 2
    normal = (((exponent + 126) << 23) | (mantissa << 22)).to(tl.float32, bitcast=True)
    value = tl.where(exponent == 0, mantissa.to(tl.float32) * 0.5, normal)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def mxfp4_tiles(b_ptr, s_ptr, e, offs_n, offs_j, n_mask, j_mask, stride_be, stride_bn, stride_se, stride_sn):
    """The [BLOCK_K / 2, BLOCK_N] tiles of w[e]^T at the even and odd columns of a K step (byte column j holds
    columns 2j and 2j + 1), each value times its group's power of two, in float32: (even, odd)."""
    mask = n_mask[None, :] & j_mask[:, None]
    byte = tl.load(b_ptr + e * stride_be + offs_n[None, :] * stride_bn + offs_j[:, None], mask=mask,
                   other=0).to(tl.int32)
    biased = tl.load(s_ptr + e * stride_se + offs_n[None, :] * stride_sn + (offs_j // 16)[:, None], mask=mask,
                     other=127).to(tl.int32)
    # 2^(s - 127) as float32 bits; s = 0 is 2^-127, a float32 subnormal
    scale = tl.where(biased == 0, 0x400000, biased << 23).to(tl.float32, bitcast=True)
    return e2m1_value(byte & 15) * scale, e2m1_value(byte >> 4) * scale


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
    for k0 in range(0, hidden, BLOCK_K):
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        j_mask = offs_j < hidden // 2
        a_mask = m_mask[:, None] & j_mask[None, :]
        a_ptrs = x_ptr + row[:, None] * stride_xm + 2 * offs_j[None, :]
        a_even = tl.load(a_ptrs, mask=a_mask, other=0.0)
        a_odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0)
        g_even, g_odd = mxfp4_tiles(b_ptr, s_ptr, e, offs_n, offs_j, n_mask, j_mask, stride_be, stride_bn,
                                    stride_se, stride_sn)
        u_even, u_odd = mxfp4_tiles(b_ptr, s_ptr, e, offs_n + inter, offs_j, n_mask, j_mask, stride_be, stride_bn,
                                    stride_se, stride_sn)
        acc_g += mma(a_even, g_even.to(a_even.dtype), UPCAST) + mma(a_odd, g_odd.to(a_odd.dtype), UPCAST)
        acc_u += mma(a_even, u_even.to(a_even.dtype), UPCAST) + mma(a_odd, u_odd.to(a_odd.dtype), UPCAST)
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
    for k0 in range(0, inter, BLOCK_K):
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        j_mask = offs_j < inter // 2
        a_mask = m_mask[:, None] & j_mask[None, :]
        a_ptrs = a_ptr + pair[:, None] * stride_am + 2 * offs_j[None, :]
        a_even = tl.load(a_ptrs, mask=a_mask, other=0.0)
        a_odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0)
        w_even, w_odd = mxfp4_tiles(b_ptr, s_ptr, e, offs_n, offs_j, n_mask, j_mask, stride_be, stride_bn,
                                    stride_se, stride_sn)
        acc += mma(a_even, w_even.to(a_even.dtype), UPCAST) + mma(a_odd, w_odd.to(a_odd.dtype), UPCAST)
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


@register("fused_moe_mxfp4", "triton")
def fused_moe_mxfp4(x: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                    w2_scales: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> torch.Tensor:
    """As the reference's (kernels/moe/reference.py), biases and clamped SwiGLU included."""
    num_experts, hidden, inter = check_shapes(x, w13_blocks, w13_scales, w2_blocks, w2_scales)
    t, top_k = topk_ids.shape
    pairs = t * top_k
    tiles = tiles_for(pairs, num_experts)  # BLOCK_K >= 32: each half-step dot keeps tl.dot's 16
    x = x.contiguous()
    sorted_ids, block_experts = align_blocks(topk_ids, num_experts, tiles.block_m)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    upcast = INTERPRET or x.dtype == torch.float32
    grid = (block_experts.numel(), triton.cdiv(inter, tiles.block_n))
    _gate_up_kernel[grid](x, w13_blocks, w13_scales, act, sorted_ids, block_experts, pairs, inter, hidden,
                          x.stride(0), w13_blocks.stride(0), w13_blocks.stride(1), w13_scales.stride(0),
                          w13_scales.stride(1), act.stride(0), TOP_K=top_k, BLOCK_M=tiles.block_m,
                          BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, UPCAST=upcast, num_stages=tiles.num_stages,
                          **({} if w13_bias is None else {"bias_ptr": w13_bias.contiguous(), "BIAS": True}),
                          **({} if swiglu_limit is None else {"limit": float(swiglu_limit),
                                                              "alpha": float(swiglu_alpha), "CLAMPED": True}))
    out = torch.zeros(pairs, hidden, dtype=torch.float32, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    grid = (block_experts.numel(), triton.cdiv(hidden, tiles.block_n))
    _down_kernel[grid](act, w2_blocks, w2_scales, out, sorted_ids, block_experts, weights, pairs, hidden, inter,
                       act.stride(0), w2_blocks.stride(0), w2_blocks.stride(1), w2_scales.stride(0),
                       w2_scales.stride(1), out.stride(0), BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
                       BLOCK_K=tiles.block_k, UPCAST=upcast, num_stages=tiles.num_stages,
                       **({} if w2_bias is None else {"bias_ptr": w2_bias.contiguous(), "BIAS": True}))
    return out.view(t, top_k, hidden).sum(dim=1).to(x.dtype)
