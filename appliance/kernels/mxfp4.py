"""MXFP4 (OCP microscaling FP4), the format gpt-oss ships its expert weights in: dequantized at load, or kept as
it is for the fused MoE kernel that dequantizes tiles in registers (kernels/moe/triton_mxfp4.py).

A checkpoint stores each expert matrix [..., N, K] as `<name>_blocks` uint8 [..., N, K / 32, 16] (two e2m1 values
per byte, the low nibble first) and `<name>_scales` uint8 [..., N, K / 32] (a power-of-two exponent per 32 values,
biased by 127). `dequantize` gives back the [..., N, K] matrix the checkpoint's values encode, exactly (every
e2m1 value times a power of two is representable in bf16 and float32). `quantize` is its inverse for tests and
tools: round to the nearest e2m1 value with the block's scale chosen so the block's largest magnitude fits 6.0.
The kernels take the blocks with their last two dimensions flattened, [..., N, K / 2] (`packed`), which is the
same bytes in the same order.
"""
from __future__ import annotations

import torch

BLOCK = 32  # values per scale
SCALE_BIAS = 127
# e2m1 code -> value; bit 3 is the sign
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., N, G, 16], scales uint8 [..., N, G] -> [..., N, G * 32] in `dtype`."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"mxfp4: blocks and scales must be uint8, got {blocks.dtype} / {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"mxfp4: blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
                         f"(expected [..., G, {BLOCK // 2}] over [..., G])")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    out = torch.ldexp(values, exponents.unsqueeze(-1))
    return out.flatten(-2).to(dtype)


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] (K a multiple of 32) -> (blocks uint8 [..., N, K/32, 16], scales uint8 [..., N, K/32])."""
    if w.shape[-1] % BLOCK:
        raise ValueError(f"mxfp4: the last dimension {w.shape[-1]} is not a multiple of {BLOCK}")
    groups = w.float().unflatten(-1, (-1, BLOCK))  # [..., N, G, 32]
    amax = groups.abs().amax(dim=-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)  # largest magnitude <= 6 after scaling
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32, device=w.device)
    codes = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = codes | ((scaled < 0) & (codes > 0)).long() << 3
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return packed, (exponent + SCALE_BIAS).to(torch.uint8)


def packed(blocks: torch.Tensor) -> torch.Tensor:
    """blocks [..., N, G, 16] -> [..., N, G * 16]: one row of bytes per output row, two k values per byte."""
    return blocks.flatten(-2)


def unpacked(blocks: torch.Tensor) -> torch.Tensor:
    """[..., N, K / 2] -> blocks [..., N, K / 32, 16], the layout `dequantize` reads."""
    return blocks.unflatten(-1, (-1, BLOCK // 2))
