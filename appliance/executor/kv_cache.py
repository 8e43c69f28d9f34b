"""Sizing and allocating the paged KV cache: one K and one V tensor per layer, [blocks, block_size, Hkv, D]."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from appliance.executor.memory_check import GIB

CPU_KV_BYTES = 1 << 30  # CPU default when max_total_tokens is unset: at most 1 GiB of KV

# fp8 is e4m3 (the OCP e4m3fn format, max 448), as in vLLM and SGLang; a byte per value halves the cache
_KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
              "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int  # on this rank
    head_dim: int
    block_size: int
    dtype: torch.dtype
    num_tensors: int = 2  # K and V; 1 for MLA's latent cache (layers that declare uses_v_cache = False)
    # a draft model's layers of another layout (speculative decoding), allocated after these on the same blocks
    drafter: KVCacheSpec | None = None
    # layers whose cache stays in this dtype (an fp8 cache's precision.kv_cache_high_precision_layers)
    high_precision_layers: tuple[int, ...] = ()
    high_precision_dtype: torch.dtype | None = None

    def layer_dtype(self, layer: int) -> torch.dtype:
        if layer in self.high_precision_layers and self.high_precision_dtype is not None:
            return self.high_precision_dtype
        return self.dtype

    @property
    def bytes_per_block(self) -> int:
        elems = self.num_tensors * self.block_size * self.num_kv_heads * self.head_dim
        own = sum(elems * torch.empty((), dtype=self.layer_dtype(i)).element_size() for i in range(self.num_layers))
        return own + (self.drafter.bytes_per_block if self.drafter is not None else 0)

    @classmethod
    def of(cls, layers: list[Any], block_size: int, dtype: torch.dtype, high_precision: tuple[int, ...] = (),
           high_precision_dtype: torch.dtype | None = None) -> KVCacheSpec:
        """The spec of attention layers (num_kv_heads, head_dim, uses_v_cache); layers after the first run of
        one layout (a draft model's) become the `drafter` spec. `high_precision` indexes `layers`."""
        first = layers[0]
        layout = (first.num_kv_heads, first.head_dim, getattr(first, "uses_v_cache", True))
        n = next((i for i, x in enumerate(layers)
                  if (x.num_kv_heads, x.head_dim, getattr(x, "uses_v_cache", True)) != layout), len(layers))
        drafter = cls.of(layers[n:], block_size, dtype) if n < len(layers) else None
        return cls(n, layout[0], layout[1], block_size, dtype, 2 if layout[2] else 1, drafter,
                   tuple(i for i in high_precision if i < n), high_precision_dtype)


def high_precision_layers(n: int, num_layers: int) -> tuple[int, ...]:
    """The first and the last n of num_layers attention layers."""
    return tuple(sorted(set(range(min(n, num_layers))) | set(range(max(0, num_layers - n), num_layers))))


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    if name == "auto":
        return model_dtype
    if name not in _KV_DTYPES:
        raise ValueError(f"precision.kv_cache_dtype {name!r} is not supported by this executor yet "
                         f"(supported: auto, {', '.join(_KV_DTYPES)})")
    return _KV_DTYPES[name]


def blocks_from_tokens(max_total_tokens: int, block_size: int) -> int:
    n = max_total_tokens // block_size
    if n < 1:
        raise ValueError(f"cache.max_total_tokens={max_total_tokens} is less than one block of {block_size} tokens")
    return n


def blocks_for_cpu(spec: KVCacheSpec, max_model_len: int, max_num_seqs: int) -> int:
    """Enough blocks for every sequence at full length, bounded by CPU_KV_BYTES (and at least one sequence)."""
    per_seq = (max_model_len + spec.block_size - 1) // spec.block_size
    wanted = per_seq * max_num_seqs
    affordable = max(CPU_KV_BYTES // spec.bytes_per_block, per_seq)
    return min(wanted, affordable)


def blocks_for_gpu(spec: KVCacheSpec, device: torch.device, utilization: float, peak_bytes: int) -> int:
    """Blocks that fit in utilization x total memory after the profiled peak of weights and activations. Like
    vLLM, the share is of the whole GPU; if less of it is free now (other processes, or other engines of this
    one), start-up stops here with the numbers instead of running out of memory while allocating."""
    total = torch.cuda.get_device_properties(device).total_memory
    free_for_kv = int(total * utilization) - peak_bytes
    n = free_for_kv // spec.bytes_per_block
    if n < 1:
        raise RuntimeError(f"no memory left for the KV cache: {utilization:.0%} of {total / GIB:.1f} GiB is "
                           f"{total * utilization / GIB:.1f} GiB and the model peaks at {peak_bytes / GIB:.1f} "
                           f"GiB; raise cache.gpu_memory_utilization or use a smaller model / more parallelism")
    free, _ = torch.cuda.mem_get_info(device)
    if n * spec.bytes_per_block > free:
        raise RuntimeError(f"the KV cache needs {n * spec.bytes_per_block / GIB:.1f} GiB (cache.gpu_memory_utilization "
                           f"{utilization:g} of {total / GIB:.1f} GiB, less the model's peak of "
                           f"{peak_bytes / GIB:.1f} GiB) but only {free / GIB:.1f} GiB of the GPU is free: other "
                           f"processes or engines hold the rest. Lower cache.gpu_memory_utilization, set "
                           f"cache.max_total_tokens, or free the GPU")
    return int(n)


def allocate(spec: KVCacheSpec, num_blocks: int, device: torch.device, layer_blocks: list[int] | None = None,
             positions: list[int] | None = None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(K, V) per layer; V is None for a one-tensor (MLA latent) cache. layer_blocks: each layer's block count
    where it differs (its KV cache group's pool: executor/window_groups.py); num_blocks for all by default.
    positions: KV cache groups sharing one pool, each layer's index in its group; the layers at one index share
    their tensors (the engine gives a block to one group at a time)."""
    counts = layer_blocks if layer_blocks is not None else [num_blocks] * spec.num_layers
    shapes = [(n, spec.block_size, spec.num_kv_heads, spec.head_dim) for n in counts]
    own: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    first: dict[int, int] = {}  # position -> the first layer at it, whose tensors the others take
    for i in range(spec.num_layers):
        if positions is not None and positions[i] in first:
            own.append(own[first[positions[i]]])
            continue
        if positions is not None:
            first[positions[i]] = i
        own.append((torch.zeros(shapes[i], dtype=spec.layer_dtype(i), device=device),
                    torch.zeros(shapes[i], dtype=spec.layer_dtype(i), device=device) if spec.num_tensors == 2
                    else None))
    return own + (allocate(spec.drafter, num_blocks, device) if spec.drafter is not None else [])


def allocate_host(spec: KVCacheSpec, num_slots: int,
                  device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """The host tier's slots (engine/host_tier.py), shaped and typed like the device caches (a drafter's
    included): pinned host memory beside a GPU, so the copies are asynchronous DMA; empty without a tier."""
    if num_slots == 0:
        return []
    shape = (num_slots, spec.block_size, spec.num_kv_heads, spec.head_dim)
    pin = device.type == "cuda"
    own = [(torch.zeros(shape, dtype=spec.layer_dtype(i), pin_memory=pin),
            torch.zeros(shape, dtype=spec.layer_dtype(i), pin_memory=pin) if spec.num_tensors == 2 else None)
           for i in range(spec.num_layers)]
    return own + (allocate_host(spec.drafter, num_slots, device) if spec.drafter is not None else [])


def release(caches: list[tuple[torch.Tensor, torch.Tensor | None]]) -> None:
    """Give the caches' memory back now (the runner's finalizer). On a GPU with the Triton backend a tensor
    object of the cache outlived its dropped engine, held by a reference gc cannot see (found by
    tests/conftest.py's report of what GPU tests leave allocated; the holder is not identified), and kept ~24 GB
    of a test process's GPU; emptying the storage frees the memory whoever holds the object."""
    free_storage(t for pair in caches for t in pair if t is not None)


def free_storage(tensors: Iterable[torch.Tensor]) -> None:
    """Empty each tensor's storage: its memory is back whoever still holds the tensor object (the runner's
    finalizers: the KV cache above, the model's weights)."""
    for t in tensors:
        t.untyped_storage().resize_(0)

