"""Ops flashinfer has no kernel for here, taken from the Triton backend rather than the torch reference (which is
what layers/kernels.py would fall back to): rope and the decode GEMV. Without triton they stay unregistered and
the layers use torch, as for any backend lacking an op. rope_store_kv (a fused op that writes the KV cache) is
never borrowed: the cache writes belong to this backend's store_kv (layers/attention.py fused_rope_store)."""
from __future__ import annotations

from appliance.kernels import registry

BORROWED_FROM_TRITON = ("rope", "gemv")

try:
    from appliance.kernels import triton as _triton
except ImportError:  # pragma: no cover - triton ships with torch on CUDA boxes
    _triton = None

if _triton is not None:
    for _op in BORROWED_FROM_TRITON:
        registry.register(_op, "flashinfer")(registry.get(_op, "triton"))
