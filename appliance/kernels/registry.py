"""One registry for every kernel: an op name maps to implementations by backend.

The "torch" implementation of each op is the plain reference in kernels/reference: the test oracle and the
CPU path. Other backends (triton, flashinfer) register the same signature with `register` when their modules are
imported. This module imports none of them: BACKEND_MODULES names the modules that register a backend's ops, and
`get` imports them (importlib) the first time the backend is asked for, so the registry stays a leaf of the
import graph (tests/test_layering.py).

`get(op, backend)` is exact: KeyError when the backend lacks the op, never a silent substitute. `resolve(op,
backend)` follows the explicit fallback order FALLBACK for an op the backend lacks (the layers' lookup for ops
other than attention: layers/kernels.py).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_REGISTRY: dict[str, dict[str, Callable[..., Any]]] = {}
_LOADED: set[str] = set()

OPS = ("store_kv", "decode_attention", "prefill_attention", "rms_norm", "rope", "silu_and_mul", "gemv", "sample",
       "rope_store_kv", "decode_positions", "verify_positions", "skinny_gemm",
       "norm_prep", "gemv_residual", "gemv_normed_silu", "gemv_normed_rope_store", "fp8_quant_act",
       "fp8_gemv", "gelu_tanh_and_mul", "norm_add_norm", "rms_norm_quant", "silu_and_mul_quant")

# the modules whose import registers a backend's ops (kernels/moe and kernels/mla register theirs for torch and
# triton when imported: layers/moe.py and layers/mla.py import them); kernels/fp8_gemm.py holds the torch
# fp8_quant_act and fp8_gemv (their triton ones: kernels/triton/act_quant.py, fp8_gemv.py), kernels/fp8_act.py the
# torch rms_norm_quant and silu_and_mul_quant (triton/norm.py, activation.py)
BACKEND_MODULES: dict[str, tuple[str, ...]] = {
    "torch": ("appliance.kernels.reference", "appliance.kernels.fp8_gemm", "appliance.kernels.fp8_act"),
    "triton": ("appliance.kernels.triton",),
    "flashinfer": ("appliance.kernels.flashinfer",),
}


@dataclass(frozen=True)
class Fallback:
    """Where `resolve` looks next for an op a backend lacks: `backend`, for `ops` only (None: any op)."""

    backend: str
    ops: frozenset[str] | None = None


# The fallback order per backend. flashinfer takes rope, the decode GEMV and the quantizing norm and activation from
# triton (never rope_store_kv or the chain ops, which write the KV cache that belongs to its own store_kv), anything
# else it lacks from torch.
FALLBACK: dict[str, tuple[Fallback, ...]] = {
    "torch": (),
    "triton": (Fallback("torch"),),
    "flashinfer": (Fallback("triton", frozenset({"rope", "gemv", "rms_norm_quant", "silu_and_mul_quant"})),
                   Fallback("torch")),
}


def register(op: str, backend: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        _REGISTRY.setdefault(op, {})[backend] = fn
        return fn

    return deco


def _load(backend: str) -> None:
    if backend in _LOADED:
        return
    if backend not in BACKEND_MODULES:
        raise KeyError(f"unknown kernel backend {backend!r}; known: {', '.join(BACKEND_MODULES)}")
    for module in BACKEND_MODULES[backend]:
        importlib.import_module(module)
    _LOADED.add(backend)


def get(op: str, backend: str = "torch") -> Callable[..., Any]:
    """The implementation of `op` for `backend`; KeyError naming what exists when there is none (ImportError when
    the backend's modules cannot be imported)."""
    _load(backend)
    impls = _REGISTRY.get(op, {})
    if backend not in impls:
        raise KeyError(f"kernel op {op!r} has no {backend!r} implementation (have: {sorted(impls)})")
    return impls[backend]


def resolve(op: str, backend: str) -> tuple[str, Callable[..., Any]]:
    """(the backend that serves `op`, its implementation): `backend`'s own, else the first in FALLBACK[backend]
    that has it and imports; KeyError when none does."""
    try:
        return backend, get(op, backend)
    except KeyError:
        if backend not in FALLBACK:
            raise
    for fallback in FALLBACK[backend]:
        if fallback.ops is not None and op not in fallback.ops:
            continue
        try:
            return fallback.backend, get(op, fallback.backend)
        except (KeyError, ImportError):  # e.g. triton not installed: the next in the order
            continue
    raise KeyError(f"kernel op {op!r}: neither {backend!r} nor its fallbacks {FALLBACK[backend]} implement it")


def backends(op: str) -> list[str]:
    return sorted(_REGISTRY.get(op, {}))
