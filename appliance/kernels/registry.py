"""One registry for every kernel: an op name maps to implementations by backend.

The "torch" implementation of each op is the plain reference in kernels/reference: the test oracle and the
CPU path. Other backends (triton, flashinfer) register the same signature; `get` falls back to torch only when
asked for "auto" on a device the backend cannot serve, never silently when a backend was named explicitly.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {}
_LOADED: set[str] = set()

OPS = ("store_kv", "decode_attention", "prefill_attention", "rms_norm", "rope", "silu_and_mul", "gemv", "sample",
       "rope_store_kv", "decode_positions", "skinny_gemm",
       "norm_prep", "gemv_residual", "gemv_normed_silu", "gemv_normed_rope_store")


def register(op: str, backend: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRY.setdefault(op, {})[backend] = fn
        return fn

    return deco


def _load(backend: str) -> None:
    if backend in _LOADED:
        return
    if backend == "torch":
        from appliance.kernels import reference  # noqa: F401  (registers on import)
    elif backend == "triton":
        from appliance.kernels import triton as _triton  # noqa: F401
    elif backend == "flashinfer":
        from appliance.kernels import flashinfer as _flashinfer  # noqa: F401
    else:
        raise KeyError(f"unknown kernel backend {backend!r}; known: torch, triton, flashinfer")
    _LOADED.add(backend)


def get(op: str, backend: str = "torch") -> Callable[..., Any]:
    """The implementation of `op` for `backend`; KeyError naming what exists when there is none."""
    _load(backend)
    impls = _REGISTRY.get(op, {})
    if backend not in impls:
        raise KeyError(f"kernel op {op!r} has no {backend!r} implementation (have: {sorted(impls)})")
    return impls[backend]


def backends(op: str) -> list[str]:
    return sorted(_REGISTRY.get(op, {}))
