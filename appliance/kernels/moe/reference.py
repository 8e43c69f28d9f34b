"""Plain-torch fused MoE: a loop over the experts that were hit (the oracle and the CPU path)."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from appliance.kernels import mxfp4
from appliance.kernels.registry import register

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def block_quantize(w: torch.Tensor, block_shape: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8 weight, float32 scale_inv [..., ceil(N/bn), ceil(K/bk)]); each tile's amax maps to 448."""
    bn, bk = block_shape
    n, k = w.shape[-2:]
    nb, kb = -(-n // bn), -(-k // bk)
    padded = F.pad(w.float(), (0, kb * bk - k, 0, nb * bn - n))
    tiles = padded.unflatten(-1, (kb, bk)).unflatten(-3, (nb, bn))  # [..., nb, bn, kb, bk]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale


def row_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> (fp8 weight, float32 scale [..., N]): each output row's amax maps to 448."""
    scale = (w.float().abs().amax(dim=-1) / FP8_MAX).clamp(min=1e-12)
    return (w.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_blocks(w: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int]) -> torch.Tensor:
    """w [..., N, K] (fp8) times its per-tile scale [..., ceil(N/bn), ceil(K/bk)] -> float32 [..., N, K]."""
    bn, bk = block_shape
    n, k = w.shape[-2:]
    s = scale.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    return w.float() * s


@register("fp8_block_matmul", "torch")
def fp8_block_matmul(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     block_shape: tuple[int, int]) -> torch.Tensor:
    """x [..., K] @ dequant(weight [N, K])^T in x's dtype."""
    return F.linear(x, dequantize_blocks(weight, scale_inv, block_shape).to(x.dtype))


def _expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int,
                   block_shape: tuple[int, int] | None, dtype: torch.dtype) -> torch.Tensor:
    if scale is None:
        return w[e]
    if scale.dim() == 2:  # one scale per output row [E, N] (per-tensor / per-channel checkpoints)
        if block_shape is not None:
            raise ValueError("per-row expert scales [E, N] take no block_shape")
        return (w[e].float() * scale[e].float()[:, None]).to(dtype)
    if block_shape is None:
        raise ValueError("block-scaled fp8 expert weights need block_shape")
    return dequantize_blocks(w[e], scale[e], block_shape).to(dtype)


def gated_activation(gate: torch.Tensor, up: torch.Tensor, swiglu_limit: float | None,
                     swiglu_alpha: float) -> torch.Tensor:
    """silu(gate) * up; with `swiglu_limit`, gpt-oss's clamped SwiGLU: gate clamped above and up on both sides
    at the limit, then (up + 1) * gate * sigmoid(alpha * gate)."""
    if swiglu_limit is None:
        return F.silu(gate) * up
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return (up + 1) * gate * torch.sigmoid(gate * swiglu_alpha)


ExpertWeights = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # expert e -> (w13[e], w2[e]) in x's dtype


def routed_sum(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
               expert: ExpertWeights, w13_bias: torch.Tensor | None, w2_bias: torch.Tensor | None,
               swiglu_limit: float | None, swiglu_alpha: float) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert ids[t, k]'s MLP of x[t], one expert hit at a time (its weights
    materialized by `expert` only then)."""
    if x.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"fused_moe: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} do not match")
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids.reshape(-1)).tolist():
        if not 0 <= e < num_experts:
            raise ValueError(f"fused_moe: expert id {e} outside 0..{num_experts - 1}")
        token, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        w13, w2 = expert(e)
        gate, up = F.linear(x[token], w13, None if w13_bias is None else w13_bias[e]).chunk(2, dim=-1)
        y = F.linear(gated_activation(gate, up, swiglu_limit, swiglu_alpha), w2, None if w2_bias is None else w2_bias[e])
        out.index_add_(0, token, y.float() * topk_weights[token, slot, None].float())
    return out.to(x.dtype)


@register("fused_moe", "torch")
def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              block_shape: tuple[int, int] | None = None, *, w13_bias: torch.Tensor | None = None,
              w2_bias: torch.Tensor | None = None, swiglu_limit: float | None = None,
              swiglu_alpha: float = 1.702) -> torch.Tensor:
    """Biases ([E, 2I] / [E, H]) and the clamped SwiGLU (`swiglu_limit`, `swiglu_alpha`) serve gpt-oss."""
    return routed_sum(x, topk_weights, topk_ids, w13.shape[0],
                      lambda e: (_expert_weight(w13, w13_scale, e, block_shape, x.dtype),
                                 _expert_weight(w2, w2_scale, e, block_shape, x.dtype)),
                      w13_bias, w2_bias, swiglu_limit, swiglu_alpha)


@register("fused_moe_mxfp4", "torch")
def fused_moe_mxfp4(x: torch.Tensor, w13_blocks: torch.Tensor, w13_scales: torch.Tensor, w2_blocks: torch.Tensor,
                    w2_scales: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    swiglu_limit: float | None = None, swiglu_alpha: float = 1.702) -> torch.Tensor:
    """The oracle of the MXFP4 expert kernel: each hit expert's blocks [N, K/2] and scales [N, K/32]
    (kernels/mxfp4.py) dequantized to x's dtype, then fused_moe's sum."""
    return routed_sum(x, topk_weights, topk_ids, w13_blocks.shape[0],
                      lambda e: (mxfp4.dequantize(mxfp4.unpacked(w13_blocks[e]), w13_scales[e], x.dtype),
                                 mxfp4.dequantize(mxfp4.unpacked(w2_blocks[e]), w2_scales[e], x.dtype)),
                      w13_bias, w2_bias, swiglu_limit, swiglu_alpha)
