"""Tensor-parallel linear layers (Megatron layout) with loaders that cut each rank's shard from a full weight.

Column-parallel layers split the output dimension (no communication); row-parallel layers split the input
dimension and all-reduce their partial sums. Fused layers (QKV, gate+up) take each checkpoint tensor with a
shard id and place it at the right offset of this rank's slice.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from appliance.kernels import cublaslt, registry
from appliance.kernels.reference.linear import GEMV_MAX_ROWS, SKINNY_GEMM_MAX_ROWS
from appliance.layers.parallel_state import (
    divide,
    get_tp_rank,
    get_tp_size,
    tp_all_gather,
    tp_all_reduce,
)

Gemv = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]
_HALF = (torch.bfloat16, torch.float16)  # fp32 stays on torch: tl.dot would round it through tf32


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemv: Gemv | None,
           skinny: Gemv | None = None) -> torch.Tensor:
    """x W^T + b: decode-sized batches (<= GEMV_MAX_ROWS rows) through the bound GEMV kernel, batches of up to
    SKINNY_GEMM_MAX_ROWS rows through the bound skinny GEMM (its Triton kernel where it measured faster than cuBLAS,
    kernels/triton/skinny_gemm.py tuned_table, cuBLAS elsewhere), the rest through torch (cuBLAS on a GPU; with a kernel
    backend bound, at the row count cublaslt.LtTables.padded measured faster). Only 2-D half precision inputs in the
    weight's dtype are routed."""
    if x.dim() != 2 or x.dtype != weight.dtype or x.dtype not in _HALF:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    if gemv is not None and 0 < rows <= GEMV_MAX_ROWS:
        return gemv(x, weight, bias)
    if skinny is not None and GEMV_MAX_ROWS < rows <= SKINNY_GEMM_MAX_ROWS:
        return skinny(x, weight, bias)
    if skinny is not None and rows > SKINNY_GEMM_MAX_ROWS:
        return cublaslt.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def use_gemv_kernel(model: nn.Module, backend: str) -> int:
    """Bind `backend`'s "gemv" op to every linear layer and LM head of `model` (layers whose weight is not in the
    compute dtype, e.g. fp8, keep their own path), and its "skinny_gemm" op, where it has one, beside it; returns
    how many layers were bound. A backend without its own GEMV (torch) binds nothing: cuBLAS already is torch's. The model runner binds on CUDA devices only."""
    if backend == "torch":
        return 0
    try:
        served_by, op = registry.resolve("gemv", backend)  # flashinfer's: triton's (the registry's fallback order)
    except KeyError:
        return 0
    if served_by == "torch":
        return 0
    try:
        skinny: Gemv | None = registry.get("skinny_gemm", backend)
    except KeyError:  # e.g. flashinfer, whose fallback to triton covers the GEMV only
        skinny = None
    bound = 0
    for module in model.modules():
        if hasattr(module, "gemv"):
            module.gemv = op
            module.skinny = skinny
            bound += 1
    return bound


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def _copy(param: torch.Tensor, loaded: torch.Tensor) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's rows (outputs) split across ranks."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.gather_output = gather_output
        self.gemv: Gemv | None = None  # use_gemv_kernel binds one
        self.skinny: Gemv | None = None  # and this, where the backend has a skinny GEMM
        self.weight = _param(self.output_size_per_partition, input_size)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = _param(self.output_size_per_partition)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        _copy(param, loaded.narrow(0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.weight, self.bias, self.gemv, self.skinny)
        return tp_all_gather(y, dim=-1) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj); shard id = index in output_sizes."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if shard_id is None:  # an already-fused checkpoint tensor: cut each part's shard
            offset = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded.narrow(0, offset, size), i)
                offset += size
            return
        shard = self.output_sizes[shard_id] // self.tp_size
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        _copy(param.data.narrow(0, offset, shard), loaded.narrow(0, self.tp_rank * shard, shard))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projections split by heads; KV heads are replicated when there are fewer than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = False) -> None:
        tp_size = get_tp_size()
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = total_num_heads, total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp_size, total_num_kv_heads)
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
            self.kv_replicas = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_dim
        super().__init__(hidden_size, output_size, bias)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if shard_id is None:  # fused checkpoint tensor laid out [q; k; v] over all heads
            q_total = self.total_num_heads * self.head_dim
            kv_total = self.total_num_kv_heads * self.head_dim
            for sid, start, size in (("q", 0, q_total), ("k", q_total, kv_total), ("v", q_total + kv_total, kv_total)):
                self.weight_loader(param, loaded.narrow(0, start, size), sid)
            return
        if shard_id == "q":
            offset, size, rank = 0, self.q_size, self.tp_rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            size, rank = self.kv_size, self.tp_rank // self.kv_replicas
        else:
            raise ValueError(f"unknown qkv shard id {shard_id!r}")
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, rank * size, size))


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's columns (inputs) split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.reduce_results = reduce_results
        self.gemv: Gemv | None = None  # use_gemv_kernel binds one
        self.skinny: Gemv | None = None  # and this, where the backend has a skinny GEMM
        self.weight = _param(output_size, self.input_size_per_partition)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = _param(output_size)
            self.bias.weight_loader = lambda p, w: _copy(p, w)  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        _copy(param, loaded.narrow(1, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = matmul(x, self.weight, None, self.gemv, self.skinny)
        if self.reduce_results:
            y = tp_all_reduce(y)
        # the bias is added once, after the sum, not once per rank
        return y + self.bias if self.bias is not None else y
