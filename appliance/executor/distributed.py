"""One worker's place in the distributed world: process-group start-up and shard-only checkpoint reads.

The supervisor gives each worker the torch convention in its environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT): the world is one tensor-parallel group (a data-parallel replica is a separate world
of its own, so replicas never wait for each other). gloo on the CPU, nccl on CUDA; on the GPUs of one host the
small all-reduces go one-shot over CUDA IPC buffers (layers/custom_all_reduce.py), set up right after the group.

Shard-only reads: with tp > 1, checkpoint tensors are handed to the weight loaders as `LazyCheckpointTensor`s,
which read from the safetensors file only the rows/columns a loader `narrow`s to (safetensors' get_slice); any
other use reads the whole tensor (replicated weights such as norms need it anyway).
"""
from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from appliance.layers.custom_all_reduce import AllReduceSettings, build_one_shot
from appliance.layers.parallel_state import (
    get_tp_size,
    init_tensor_parallel,
    set_one_shot_all_reduce,
)

log = logging.getLogger(__name__)

# a rank that never arrives (crashed at import) must not hang the others for torch's default 30 min
INIT_TIMEOUT_S = 300


@dataclass(frozen=True)
class DistributedEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> DistributedEnv:
        e = os.environ if env is None else env
        world = int(e.get("WORLD_SIZE", "1"))
        d = cls(int(e.get("RANK", "0")), world, int(e.get("LOCAL_RANK", e.get("RANK", "0"))),
                e.get("MASTER_ADDR", "127.0.0.1"), int(e.get("MASTER_PORT", "0")))
        if world < 1 or not 0 <= d.rank < world:
            raise ValueError(f"invalid distributed environment: RANK={d.rank} WORLD_SIZE={world}")
        if world > 1 and not d.master_port:
            raise ValueError("WORLD_SIZE > 1 needs MASTER_PORT (the supervisor sets it)")
        return d

    def to_env(self) -> dict[str, str]:
        return {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": str(self.local_rank),
                "MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def init_distributed(device_name: str, env: DistributedEnv | None = None, *,
                     all_reduce: AllReduceSettings | None = None) -> DistributedEnv:
    """Join this worker's tensor-parallel group (no-op at world size 1) and set up its all-reduce (the one-shot
    over CUDA IPC buffers where it applies, `all_reduce` = AllReduceSettings.from_config(config)); call before
    building the model."""
    d = env or DistributedEnv.from_env()
    if d.world_size == 1:
        init_tensor_parallel(0, 1)
        return d
    import torch.distributed as dist

    cuda = device_name == "cuda" or (device_name == "auto" and torch.cuda.is_available())
    if cuda:  # one visible device per worker (parallelism.devices) or device LOCAL_RANK of the node's list
        count = torch.cuda.device_count()
        if d.local_rank >= count:  # two ranks on one GPU would fail later inside NCCL, less clearly
            raise RuntimeError(f"worker with local rank {d.local_rank} but {count} CUDA device(s) visible: this node "
                               "runs more workers than it has GPUs (see parallelism.tp / dp / devices)")
        torch.cuda.set_device(d.local_rank)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{d.master_addr}:{d.master_port}", rank=d.rank,
                            world_size=d.world_size, timeout=datetime.timedelta(seconds=INIT_TIMEOUT_S))
    init_tensor_parallel(d.rank, d.world_size, dist.group.WORLD)
    log.info("rank %d of %d joined (%s, %s:%d)", d.rank, d.world_size, backend, d.master_addr, d.master_port)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    impl, line = build_one_shot(all_reduce or AllReduceSettings(), dist.group.WORLD, d.rank, d.world_size, device)
    set_one_shot_all_reduce(impl)
    log.info("rank %d: %s", d.rank, line)
    return d


def min_over_ranks(value: int) -> int:
    """The smallest `value` of all ranks of this worker's group (itself at world size 1)."""
    if get_tp_size() == 1:
        return value
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def shutdown_distributed() -> None:
    import torch.distributed as dist

    set_one_shot_all_reduce(None)  # its symmetric buffer belongs to the group about to go
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    init_tensor_parallel(0, 1)


class LazyCheckpointTensor:
    """A checkpoint tensor not yet read: `narrow` (and basic slicing) stay lazy, anything else reads it.

    Torch functions receiving one (param.copy_(t), torch.cat, ...) read it through __torch_function__;
    attribute access (t.float(), t.dtype, ...) reads it through __getattr__.
    """

    def __init__(self, source: Any, shape: tuple[int, ...], index: tuple[slice, ...] | None = None) -> None:
        self._source = source  # a safetensors PySafeSlice
        self._full_shape = tuple(shape)
        self._index = index or tuple(slice(0, n) for n in shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(s.stop - s.start for s in self._index)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return len(self._index)

    def narrow(self, dim: int, start: int, length: int) -> LazyCheckpointTensor:
        dim = dim % self.dim()
        cur = self._index[dim]
        if start < 0 or length < 0 or cur.start + start + length > cur.stop:
            raise IndexError(f"narrow({dim}, {start}, {length}) outside a tensor of shape {tuple(self.shape)}")
        index = list(self._index)
        index[dim] = slice(cur.start + start, cur.start + start + length)
        return LazyCheckpointTensor(self._source, self._full_shape, tuple(index))

    def __getitem__(self, key: Any) -> Any:
        keys = key if isinstance(key, tuple) else (key,)
        if all(isinstance(k, slice) and k.step in (None, 1) for k in keys) and len(keys) <= self.dim():
            out = self
            for dim, k in enumerate(keys):
                start, stop, _ = k.indices(out.shape[dim])
                out = out.narrow(dim, start, max(stop - start, 0))
            return out
        if isinstance(key, int) and self.dim() > 1:  # one row of a stacked tensor (fused experts)
            return self.narrow(0, key % self.shape[0], 1).materialize().squeeze(0)
        return self.materialize()[key]

    def materialize(self) -> torch.Tensor:
        return self._source[self._index]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        def real(x: Any) -> Any:
            if isinstance(x, LazyCheckpointTensor):
                return x.materialize()
            if isinstance(x, (list, tuple)):
                return type(x)(real(v) for v in x)
            return x

        return func(*real(args), **{k: real(v) for k, v in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"LazyCheckpointTensor(shape={tuple(self.shape)})"


def checkpoint_tensor(handle: Any, name: str) -> Any:
    """The tensor `name` of an open safetensors file: lazy when this worker holds shards (tp > 1)."""
    if get_tp_size() == 1:
        return handle.get_tensor(name)
    part = handle.get_slice(name)
    return LazyCheckpointTensor(part, tuple(part.get_shape()))
