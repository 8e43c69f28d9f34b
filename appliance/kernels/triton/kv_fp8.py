"""The fp8 KV cache in the Triton kernels: launch arguments and the saturating store (kernels/reference/kv_quant.py
holds the numbers). Every kernel that touches the cache takes KV_FP8 (a constexpr: the 16-bit path compiles as
before), FP8_MAX and per-kv-head float32 scale pointers. Readers convert fp8 to the query's dtype (exact: e4m3
and e5m2 values are bf16 / fp16 values) and fold the scales into the softmax scale (k) and the output (v), both
one number per kv head, so the inner loop does no extra multiply."""
from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from appliance.kernels.reference.kv_quant import FP8_MAX, kv_scale
from appliance.kernels.triton.common import INTERPRET

# Triton's CPU interpreter (3.9) rounds float32 -> fp8 wrongly: half up instead of to even, and a carry out of the
# mantissa is dropped (31.9 -> e4m3 gives 16, not 32). There the stores round to the fp8 grid themselves first, so
# the cast is exact; the GPU's conversion (round to nearest even) is used as it is.
_ROUND_FIRST = tl.constexpr(INTERPRET)
_MAGIC = 12582912.0  # 1.5 * 2**23: (q + it) - it rounds a float32 |q| < 2**22 to the nearest even integer


def kv_fp8_args(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None, op: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """(k scale, v scale, constexprs) of a launch: the [Hkv] scales of an fp8 cache (ones when not given), the
    cache itself as an unused pointer for a 16-bit one."""
    ks, vs = kv_scale(k_cache, k_scale, op), kv_scale(v_cache, v_scale, op)
    if ks is None or vs is None:
        return k_cache, v_cache, {"KV_FP8": False, "FP8_MAX": 0.0}
    if ks.device != k_cache.device or vs.device != v_cache.device:
        raise ValueError(f"{op}: the KV scales live on {ks.device}, the cache on {k_cache.device}")
    return ks, vs, {"KV_FP8": True, "FP8_MAX": FP8_MAX[k_cache.dtype]}


@triton.jit
def _round_to_fp8_grid(y, FP8_MAX: tl.constexpr):
    """y (float32, within +-FP8_MAX) rounded to the nearest fp8 value, ties to even (e4m3: 3 mantissa bits, the
    smallest normal 2^-6; e5m2: 2 bits, 2^-14)."""
    if FP8_MAX == 448.0:
        MBITS: tl.constexpr = 3
        EMIN: tl.constexpr = -6
    else:
        MBITS: tl.constexpr = 2
        EMIN: tl.constexpr = -14
    exp = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    step_exp = tl.maximum(exp, EMIN) - MBITS  # subnormals share the smallest normal's step
    step = ((step_exp + 127) << 23).to(tl.float32, bitcast=True)
    return ((y / step + _MAGIC) - _MAGIC) * step


@triton.jit
def saturate(x, scale, FP8_MAX: tl.constexpr):
    """x / scale clamped to the fp8 format's finite range, in float32, ready for the cast to the cache dtype."""
    y = tl.div_rn(x.to(tl.float32), scale)  # IEEE division, as torch's: the same fp8 value, not a step off
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    if _ROUND_FIRST:
        y = _round_to_fp8_grid(y, FP8_MAX)
    return y
