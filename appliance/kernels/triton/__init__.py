"""Triton kernels, one module per op family; importing this package registers every op under "triton".

Importing needs only `triton` (it compiles nothing); running needs a CUDA GPU or TRITON_INTERPRET=1 set before
triton is first imported (the CPU tests do this in a subprocess).
"""
from __future__ import annotations

from appliance.kernels.triton import (  # noqa: F401
    act_quant,
    activation,
    cache,
    causal_conv,
    decode,
    delta_gates,
    fp8_gemv,
    gemv,
    gated_delta,
    gemv_chain,
    norm,
    positions,
    prefill,
    rope,
    rope_store,
    sampling,
    skinny_gemm,
)
