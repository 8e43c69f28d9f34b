"""Fused mixture-of-experts kernels (op "fused_moe"): importing this package registers every backend it can.

    fused_moe(x[T,H], w13[E,2I,H], w2[E,H,I], topk_weights[T,K] float32, topk_ids[T,K] int,
              w13_scale=None, w2_scale=None, block_shape=None) -> [T,H]

w13 stacks each expert's gate (rows 0..I) and up (rows I..2I) projections; the output is
sum_k topk_weights[t,k] * w2[e] @ (silu(gate_e x) * up_e x) with e = topk_ids[t,k]. With fp8 weights
(float8_e4m3fn) the scales are the checkpoint's `weight_scale_inv` per [block_n, block_k] tile:
w13_scale [E, ceil(2I/bn), ceil(H/bk)], w2_scale [E, ceil(H/bn), ceil(I/bk)].

Op "fused_moe_mxfp4" is the same over experts kept in MXFP4 (kernels/mxfp4.py; triton_mxfp4.py has its signature).
"""
from __future__ import annotations

from appliance.kernels.moe import reference  # noqa: F401  (registers "torch")

try:  # the Triton version needs only `triton` to import; it runs on a GPU or under TRITON_INTERPRET=1
    from appliance.kernels.moe import triton_fp8, triton_moe, triton_mxfp4
except ImportError:  # pragma: no cover - triton missing: the torch reference still serves
    triton_moe = triton_fp8 = triton_mxfp4 = None  # type: ignore[assignment]
