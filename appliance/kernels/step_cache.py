"""What an op builds once per step from the step's metadata tensors and reuses in every layer.

Ops are called once per layer with the same metadata tensors (the runner builds them anew every eager step), so
anything derived from them alone (flashinfer's plans, the Triton prefill's tile map) is built by the first layer's
call and reused by the others. The key is the identity of the tensors, held here so that a later tensor cannot
reuse their id (the same holds for the host lists of a step's metadata, kernels/triton/gated_delta.py). A rewrite
of the same tensor in place (a CUDA graph's static buffers) would not be noticed: only ops that never run inside
captured graphs use it.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class StepCache:
    """One entry: the last step's metadata tensors and what was built for them."""

    def __init__(self) -> None:
        self._tensors: tuple[torch.Tensor | list[Any], ...] = ()
        self._extra: Any = None
        self._value: Any = None

    def get(self, tensors: Sequence[torch.Tensor | list[Any]], extra: Any, build: Callable[[], Any]) -> Any:
        same = (len(tensors) == len(self._tensors) and all(a is b for a, b in zip(tensors, self._tensors))
                and extra == self._extra)
        if not same:
            self._value = build()
            self._tensors, self._extra = tuple(tensors), extra
        return self._value

    def forget(self) -> None:
        """The wrapper was planned for something else: the next call plans again."""
        self._tensors, self._extra, self._value = (), None, None
