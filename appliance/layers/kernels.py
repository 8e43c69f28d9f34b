"""Kernel lookup for the layers: `backends.attention` picks the attention kernels (never substituted); the
other ops (norm, rope, activation) use that backend's version when it has one, else the next in the registry's
fallback order (kernels/registry.py FALLBACK; the torch reference last)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from appliance.kernels import registry

ATTENTION_OPS = ("store_kv", "decode_attention", "prefill_attention")


def kernel(op: str, backend: str) -> Callable[..., Any]:
    if op in ATTENTION_OPS:
        return registry.get(op, backend)
    return registry.resolve(op, backend)[1]
