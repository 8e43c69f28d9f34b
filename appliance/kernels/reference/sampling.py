"""Reference token sampling (op "sample"): the oracle for the Triton sampler and the CPU path.

Semantics and the counter-based random numbers are described in appliance/kernels/triton/sampling.py; the uniforms
here are bit-identical to the kernel's and the race values (`race_value`, exact logs in float64) agree with its
approximate ones to ~1e-5, so only a near tie can draw another token.
"""
from __future__ import annotations

import torch

from appliance.kernels.registry import register

_M32 = 0xFFFFFFFF
LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
NEAR_ONE = 1.0 / 16.0  # the kernel takes E = -ln u from a series in 1 - u when 1 - u is below this


# ---------------------------------------------------------------- counter-based random numbers (shared definition)
def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """(h * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    return (h * (c & 0xFFFF) + (((h * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_reference(seed: int, step: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The kernel's uniforms in (0, 1) for one row: float32 [n]. 23 bits and a half: (k + 0.5) / 2^23 is exact in
    float32 up to 1 - 2^-24, where 24 bits would round the top value to 1 (and -ln 1 = 0 wins every race)."""
    s = _fmix32(torch.tensor([seed & _M32], dtype=torch.int64) ^ _fmix32(torch.tensor([(step + 0x632BE5AB) & _M32])))
    idx = torch.arange(n, dtype=torch.int64)
    h = _fmix32(s ^ _fmix32(idx))
    return (((h >> 9).float() + 0.5) * (1.0 / 8388608.0)).to(device)


def race_value(lv: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The Gumbel race value the kernel approximates, exactly (float64): lv log2(e) - log2(-ln u)."""
    return lv.double() * LOG2E - torch.log2(-torch.log(u.double()))


# ---------------------------------------------------------------- torch reference
@register("sample", "torch")
def sample_reference(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    bsz, vocab = logits.shape
    out = torch.empty(bsz, dtype=torch.int64, device=logits.device)
    for b in range(bsz):
        x = logits[b].float()
        t = float(temperature[b])
        if t <= 0.0:
            out[b] = torch.argmax(x)
            continue
        lv = x * (1.0 / temperature[b : b + 1].float())  # as the kernel: one reciprocal, then multiply
        keep = torch.ones(vocab, dtype=torch.bool, device=x.device)
        mp, k, p = float(min_p[b]), int(top_k[b]), float(top_p[b])
        if mp > 0.0:
            probs = torch.softmax(lv, 0)
            keep &= probs >= mp * probs.max()
        if 0 < k < vocab:
            keep &= lv >= torch.topk(lv, k).values[-1]
        if p < 1.0:
            probs = torch.softmax(lv.masked_fill(~keep, float("-inf")), 0)
            sorted_p, order = torch.sort(probs, descending=True)
            mass_above = torch.cumsum(sorted_p, 0) - sorted_p  # mass strictly above each token
            kept_sorted = order[mass_above < p]
            keep &= lv >= lv[kept_sorted].min()
        u = uniform_reference(int(seeds[b]), int(steps[b]), vocab, x.device)
        g = race_value(lv, u).masked_fill(~keep, float("-inf"))
        out[b] = torch.argmax(g)
    return out
