"""The compute capability of a tensor's CUDA device, cached: the launch paths of the Triton kernels and the
cuBLAS tables (kernels/cublaslt.py, measured for sm_90) ask on every call. Backend-neutral: no triton import."""
from __future__ import annotations

import functools

import torch


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability(t: torch.Tensor) -> tuple[int, int]:
    """The compute capability of the CUDA device holding `t`."""
    return _capability(t.device.index if t.device.index is not None else torch.cuda.current_device())
