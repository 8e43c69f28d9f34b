"""Tensor-parallel group state: rank, size and the collectives the layers need.

At world size 1 (the default, and every CPU test) the collectives are identities; the parallelism work calls
`init_tensor_parallel` with a torch.distributed group and the same layer code then shards for real.
`tp_all_reduce` is the one place that picks the all-reduce: the one-shot over CUDA IPC buffers
(layers/custom_all_reduce.py) for small GPU messages when the group has it, torch.distributed (NCCL / gloo) else.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class TensorParallelState:
    rank: int = 0
    size: int = 1
    group: object | None = None  # a torch.distributed ProcessGroup when size > 1


_STATE = TensorParallelState()
_EXPERT_PARALLEL = False  # experts split whole over the tensor-parallel group instead of tensor-split


def init_expert_parallel(enabled: bool) -> None:
    """parallelism.enable_expert_parallel: the tensor-parallel ranks are also the expert-parallel ranks (ep = tp);
    set once per worker, before building the model."""
    global _EXPERT_PARALLEL
    _EXPERT_PARALLEL = bool(enabled)


def get_ep_rank() -> int:
    return _STATE.rank if _EXPERT_PARALLEL else 0


def get_ep_size() -> int:
    return _STATE.size if _EXPERT_PARALLEL else 1


def init_tensor_parallel(rank: int, size: int, group: object | None = None) -> None:
    """Set this process's tensor-parallel rank and group (once per worker, before building the model)."""
    global _STATE
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank {rank} for size {size}")
    if size > 1 and group is None:
        raise ValueError("tensor-parallel size > 1 needs a torch.distributed process group")
    _STATE = TensorParallelState(rank, size, group)
    set_one_shot_all_reduce(None)  # a new group: its one-shot buffers (if any) are set up after this


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


class OneShot(Protocol):
    """layers/custom_all_reduce.OneShotAllReduce, or a test stand-in."""

    def fits(self, x: torch.Tensor) -> bool: ...

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


_ONE_SHOT: OneShot | None = None  # the one-shot all-reduce over CUDA IPC buffers, when this group can use it


def set_one_shot_all_reduce(impl: OneShot | None) -> None:
    """Install (or remove) the group's one-shot all-reduce (executor/distributed.py, after init_process_group)."""
    global _ONE_SHOT
    _ONE_SHOT = impl


def all_reduce_kind(x: torch.Tensor) -> str:
    """Which all-reduce `tp_all_reduce(x)` uses: "identity" (size 1), "one_shot" or "torch" (NCCL / gloo).
    The one place that chooses: small CUDA messages go one-shot when the group has it, the rest to torch."""
    if _STATE.size == 1:
        return "identity"
    if _ONE_SHOT is not None and _ONE_SHOT.fits(x):
        return "one_shot"
    return "torch"


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group (in place when distributed; identity at size 1)."""
    kind = all_reduce_kind(x)
    if kind == "identity":
        return x
    if kind == "one_shot":
        assert _ONE_SHOT is not None
        return _ONE_SHOT(x)
    import torch.distributed as dist

    dist.all_reduce(x, group=_STATE.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's shard along `dim`, in rank order (identity at size 1)."""
    if _STATE.size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x.contiguous(), group=_STATE.group)
    return torch.cat(parts, dim=dim)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator
