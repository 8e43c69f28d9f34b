"""The fused MoE over MXFP4 expert weights (op "fused_moe_mxfp4"): 16-bit activations x e2m1 weights, dequantized
tile by tile in registers, 16-bit MMA with float32 accumulation. The experts stay in memory as the checkpoint
ships them (kernels/mxfp4.py: 4.25 bits a weight), so a decode step reads about a quarter of the bytes of the
dequantized stack.

    fused_moe_mxfp4(x[T,H], w13_blocks[E,2I,H/2] u8, w13_scales[E,2I,H/32] u8, w2_blocks[E,H,I/2] u8,
                    w2_scales[E,H,I/32] u8, topk_weights[T,K] f32, topk_ids[T,K], *, w13_bias=None, w2_bias=None,
                    swiglu_limit=None, swiglu_alpha=1.702) -> [T,H]

The shape of triton_moe.py: the same expert sort and tile alignment (`align_blocks`, `tiles_for`), a gate/up GEMM
with the activation fused, a down GEMM times the routing weight. Each K step (whole 32-value scale groups, dividing
K: no step is partial) multiplies the activation tile by the packed weight tile through `tl.dot_scaled` (bf16 or
fp16 x e2m1 with e8m0 scales): Triton's own MX product, which on Hopper upcasts the weight tile to 16 bits in
registers (a table lookup per nibble pair, a packed multiply by the scale) and runs the MMA; on the tile shapes
here it took about half the instructions per weight of decoding the nibbles by hand (sm_90 SASS). Float32
activations (the CPU tests) take the hand-decoded tile and a float32 dot instead: dot_scaled has no float32 side.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from appliance.kernels.moe.triton_moe import (
    align_blocks,
    expert_tile,
    store_gated,
    store_routed,
    tiles_for,
)
from appliance.kernels.mxfp4 import BLOCK
from appliance.kernels.registry import register


@triton.jit
def e2m1_tiny(code):
    """e2m1 codes (int32, the low 4 bits: sign, 2 exponent bits with bias 1, 1 mantissa bit) -> value * 2^-14 in
    float32: moved into a half's exponent and mantissa fields the code is that half exactly (codes of exponent 0
    land on the half's subnormals), and half -> float32 is exact."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def float32_tile(packed, biased, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """The packed [BLOCK_K / 2, BLOCK_N] tile (byte j: k = 2j low nibble, 2j + 1 high) with each byte's scale
    exponent `biased` -> the [BLOCK_K, BLOCK_N] float32 weights."""
    code = packed.to(tl.int32)
    scale = ((biased.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127), e2m1_tiny's 2^-14 undone
    pairs = tl.join(e2m1_tiny(code) * scale, e2m1_tiny(code >> 4) * scale)  # [BLOCK_K / 2, BLOCK_N, 2]
    return tl.reshape(tl.permute(pairs, (0, 2, 1)), (BLOCK_K, BLOCK_N))


@triton.jit
def mxfp4_dot(acc, a, b_ptr, s_ptr, e, offs_n, n_mask, k0, stride_be, stride_bn, stride_se, stride_sn,
              BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, ACT_FORMAT: tl.constexpr):
    """acc + a [BLOCK_M, BLOCK_K] @ the [BLOCK_K, BLOCK_N] tile of w[e]^T at k0 (columns offs_n of w[e]).
    ACT_FORMAT: a's dot_scaled format ("bf16" / "fp16"), or "fp32" for the hand-decoded float32 product."""
    offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    packed = tl.load(b_ptr + e * stride_be + offs_n[None, :] * stride_bn + offs_j[:, None], mask=n_mask[None, :],
                     other=0)
    if ACT_FORMAT == "fp32":
        biased = tl.load(s_ptr + e * stride_se + offs_n[None, :] * stride_sn + (offs_j // 16)[:, None],
                         mask=n_mask[None, :], other=0)
        acc = acc + tl.dot(a, float32_tile(packed, biased, BLOCK_K, BLOCK_N))
    else:
        offs_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        scales = tl.load(s_ptr + e * stride_se + offs_n[:, None] * stride_sn + offs_g[None, :],
                         mask=n_mask[:, None], other=0)  # [BLOCK_N, BLOCK_K / 32]: dot_scaled's right-hand scales
        acc = tl.dot_scaled(a, None, ACT_FORMAT, packed, scales, "e2m1", acc)
    return acc


@triton.jit
def _gate_up_kernel(x_ptr, b_ptr, s_ptr, out_ptr, ids_ptr, experts_ptr, num_pairs, inter, hidden,
                    stride_xm, stride_be, stride_bn, stride_se, stride_sn, stride_om,
                    TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    ACT_FORMAT: tl.constexpr, bias_ptr=None, limit=0.0, alpha=1.702, BIAS: tl.constexpr = False,
                    CLAMPED: tl.constexpr = False):
    e, pair, m_mask, offs_n, n_mask = expert_tile(experts_ptr, ids_ptr, num_pairs, inter, BLOCK_M, BLOCK_N)
    if e < 0:  # a block past the used length
        return
    row = pair // TOP_K
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):  # BLOCK_K divides hidden
        a = tl.load(x_ptr + row[:, None] * stride_xm + k0 + tl.arange(0, BLOCK_K)[None, :], mask=m_mask[:, None],
                    other=0.0)
        acc_g = mxfp4_dot(acc_g, a, b_ptr, s_ptr, e, offs_n, n_mask, k0, stride_be, stride_bn, stride_se, stride_sn,
                          BLOCK_K, BLOCK_N, ACT_FORMAT)
        acc_u = mxfp4_dot(acc_u, a, b_ptr, s_ptr, e, offs_n + inter, n_mask, k0, stride_be, stride_bn, stride_se,
                          stride_sn, BLOCK_K, BLOCK_N, ACT_FORMAT)
    store_gated(acc_g, acc_u, e, pair, m_mask, offs_n, n_mask, inter, out_ptr, stride_om, bias_ptr, limit, alpha, BIAS,
                CLAMPED)


@triton.jit
def _down_kernel(a_ptr, b_ptr, s_ptr, out_ptr, ids_ptr, experts_ptr, weights_ptr, num_pairs, hidden, inter,
                 stride_am, stride_be, stride_bn, stride_se, stride_sn, stride_om,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACT_FORMAT: tl.constexpr,
                 bias_ptr=None, BIAS: tl.constexpr = False):
    e, pair, m_mask, offs_n, n_mask = expert_tile(experts_ptr, ids_ptr, num_pairs, hidden, BLOCK_M, BLOCK_N)
    if e < 0:  # a block past the used length
        return
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):  # BLOCK_K divides inter
        a = tl.load(a_ptr + pair[:, None] * stride_am + k0 + tl.arange(0, BLOCK_K)[None, :], mask=m_mask[:, None],
                    other=0.0)
        acc = mxfp4_dot(acc, a, b_ptr, s_ptr, e, offs_n, n_mask, k0, stride_be, stride_bn, stride_se, stride_sn,
                        BLOCK_K, BLOCK_N, ACT_FORMAT)
    store_routed(acc, e, pair, m_mask, offs_n, n_mask, hidden, out_ptr, stride_om, weights_ptr, bias_ptr, BIAS)


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


# an activation dtype -> mxfp4_dot's ACT_FORMAT
ACT_FORMATS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


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
    act_format = ACT_FORMATS.get(x.dtype)
    if act_format is None:
        raise ValueError(f"fused_moe_mxfp4: activations in {x.dtype}; it takes {', '.join(map(str, ACT_FORMATS))}")
    grid = (block_experts.numel(), triton.cdiv(inter, tiles.block_n))
    _gate_up_kernel[grid](x, w13_blocks, w13_scales, act, sorted_ids, block_experts, pairs, inter, hidden,
                          x.stride(0), w13_blocks.stride(0), w13_blocks.stride(1), w13_scales.stride(0),
                          w13_scales.stride(1), act.stride(0), TOP_K=top_k, BLOCK_M=tiles.block_m,
                          BLOCK_N=tiles.block_n, BLOCK_K=whole_steps(hidden, tiles.block_k), ACT_FORMAT=act_format,
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
                       BLOCK_K=whole_steps(inter, tiles.block_k), ACT_FORMAT=act_format, num_stages=tiles.num_stages,
                       **({} if w2_bias is None else {"bias_ptr": w2_bias.contiguous(), "BIAS": True}))
    return out.view(t, top_k, hidden).sum(dim=1).to(x.dtype)
