"""One selfcheck case: an op's random inputs, the error measure against the torch reference, and its result.

Shared by the selfcheck modules (selfcheck.py, selfcheck_attention.py, selfcheck_fp8.py) and benchmarks/kernels.py.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TOL = {torch.float32: 5e-3, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class CheckResult:
    op: str
    case: str
    err: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.err <= self.tol  # NaN fails


@dataclass(frozen=True)
class Inputs:
    """Positional args for the op; `nbytes` is the least traffic a kernel must move (for GB/s)."""
    args: tuple[Any, ...]
    nbytes: int
    fast_kwargs: tuple[tuple[str, Any], ...] = ()  # extra keyword args for the triton op only (e.g. num_splits)
    kwargs: tuple[tuple[str, Any], ...] = ()  # keyword args of both ops (sliding_window, sinks)


Case = tuple[str, str, Callable[[], Inputs]]  # (op, case name, builder of its inputs)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))
