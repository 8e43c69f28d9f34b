"""Plain-torch reference kernels: the oracle for every other backend and the CPU path."""
from __future__ import annotations

from appliance.kernels.reference import (  # noqa: F401
    activation,
    attention,
    gated_delta,
    gemv_chain,
    linear,
    norm,
    positions,
    rope,
    rope_store,
    sampling,
)
