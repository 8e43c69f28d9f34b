"""FP8 KV cache numbers: which cache dtypes are fp8, their largest finite value, and the saturating quantize /
dequantize every backend matches.

A cache entry is stored as fp8(clamp(x / scale, -max, max)) and read back as fp8 * scale, with one float32 scale
per kv head ([Hkv]; a per-tensor scale is that value repeated). The clamp comes before the cast because a cast of
an out-of-range value gives NaN in e4m3 (it has no infinity) and inf in e5m2; saturating keeps the cache finite
whatever the activations do.
"""
from __future__ import annotations

import torch

# the largest finite value of each fp8 cache dtype (torch.finfo(dtype).max)
FP8_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


def kv_scale(cache: torch.Tensor, scale: torch.Tensor | None, name: str) -> torch.Tensor | None:
    """The [Hkv] float32 scale of an fp8 `cache` (ones when the caller has none), None for a 16-bit cache. A
    scale given for a 16-bit cache is an error: it would be silently ignored."""
    hkv = cache.shape[2]
    if not is_fp8(cache.dtype):
        if scale is not None:
            raise ValueError(f"{name}: a scale was given for a {cache.dtype} cache (scales apply to fp8 caches)")
        return None
    if scale is None:
        return torch.ones(hkv, dtype=torch.float32, device=cache.device)
    if scale.shape != (hkv,) or scale.dtype != torch.float32:
        raise ValueError(f"{name}: scale {tuple(scale.shape)} {scale.dtype} is not [{hkv}] float32 (one per kv head)")
    return scale


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x [..., Hkv, D] -> fp8 `dtype`, divided by the per-head scale and saturated at the format's max."""
    limit = FP8_MAX[dtype]
    return (x.float() / scale[:, None]).clamp(-limit, limit).to(dtype)


def dequantize(c: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """A cache slice [..., Hkv, D] in float32: times the per-head scale when fp8, as is otherwise."""
    return c.float() * scale[:, None] if scale is not None else c.float()
