"""FP8 (e4m3) weights with per-tile scales, the layout DeepSeek-V3/R1 ship: `weight` float8_e4m3fn [N, K] and
`weight_scale_inv` float32 [ceil(N/bn), ceil(K/bk)] (usually 128x128 tiles), with W ~= weight * scale_inv.

Activations stay in the model dtype (weight-only dequantization): the torch path dequantizes and multiplies,
the Triton path (kernels/moe/triton_fp8.py) scales each fp8 tile inside the GEMM. `make_linear` builds the
plain tensor-parallel layer or its fp8 twin from one call, so model code does not branch on quantization.

precision.quantization = "fp8" on a float checkpoint: `quantize_model_fp8` turns every loaded linear layer and
expert stack of any model into this same layout (128x128 tiles) after loading, so one kernel family serves
shipped and quantized-at-load weights alike. Like vLLM's online fp8 (`fp8_per_block`: every Linear and MoE weight
but the LM head, 128x128 block scales) except that activations stay in the model dtype here (weight-only, W8A16)
where vLLM also quantizes them per 1x128 block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from appliance.kernels import registry
from appliance.kernels.moe.reference import FP8_DTYPE, block_quantize, dequantize_blocks
from appliance.kernels.moe.reference import fp8_block_matmul as reference_fp8_block_matmul
from appliance.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from appliance.layers.parallel_state import tp_all_gather, tp_all_reduce

if TYPE_CHECKING:
    from transformers import PretrainedConfig



@dataclass(frozen=True)
class Fp8BlockConfig:
    block_n: int = 128
    block_k: int = 128
    ignored: tuple[str, ...] = ()  # module name fragments left unquantized (modules_to_not_convert)

    @property
    def block_shape(self) -> tuple[int, int]:
        return self.block_n, self.block_k

    @classmethod
    def from_hf(cls, hf_config: PretrainedConfig) -> Fp8BlockConfig | None:
        """The checkpoint's quantization_config, or None for an unquantized model; unsupported schemes fail."""
        qc = getattr(hf_config, "quantization_config", None)
        if not qc:
            return None
        qc = qc if isinstance(qc, dict) else qc.to_dict()
        method = qc.get("quant_method")
        if method != "fp8":
            raise ValueError(f"checkpoint quantization {method!r} is not supported (supported: block-wise fp8)")
        block = qc.get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError("fp8 checkpoints without weight_block_size (per-tensor scales) are not supported yet")
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError(f"fp8 activation_scheme {qc.get('activation_scheme')!r} is not supported (dynamic only)")
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 format {qc.get('fmt')!r} is not supported (e4m3 only)")
        return cls(int(block[0]), int(block[1]), tuple(qc.get("modules_to_not_convert") or ()))

    def applies_to(self, prefix: str) -> bool:
        return not any(frag in prefix for frag in self.ignored)


def _matmul_op(backend: str) -> Any:
    try:
        return registry.get("fp8_block_matmul", backend)
    except KeyError:
        return reference_fp8_block_matmul


def _fp8_params(module: nn.Module, rows: int, cols: int, quant: Fp8BlockConfig) -> None:
    """Swap the float weight for an fp8 one of the same shape plus its tile scales (same loader on both)."""
    loader = module.weight.weight_loader  # type: ignore[union-attr]
    module.weight = nn.Parameter(torch.empty(rows, cols, dtype=FP8_DTYPE), requires_grad=False)
    module.weight.weight_loader = loader  # type: ignore[attr-defined]
    module.weight_scale_inv = nn.Parameter(
        torch.empty(-(-rows // quant.block_n), -(-cols // quant.block_k), dtype=torch.float32), requires_grad=False)
    module.weight_scale_inv.weight_loader = loader  # type: ignore[attr-defined]


def _check_split(size: int, block: int, what: str) -> None:
    if size % block:
        raise ValueError(f"fp8 {what} of {size} per rank is not a multiple of the {block}-wide scale tiles; "
                         f"use a tensor-parallel size that keeps whole tiles on each rank")


class ReplicatedLinear(nn.Module):
    """y = x W^T + b with the full weight on every rank (small projections, routers)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Fp8ReplicatedLinear(ReplicatedLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool, quant: Fp8BlockConfig,
                 backend: str = "torch") -> None:
        super().__init__(input_size, output_size, bias)
        self.quant, self._mm = quant, _matmul_op(backend)
        _fp8_params(self, output_size, input_size, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(x, self.weight, self.weight_scale_inv, self.quant.block_shape)
        return y + self.bias if self.bias is not None else y


class Fp8ColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool, quant: Fp8BlockConfig,
                 backend: str = "torch", gather_output: bool = False) -> None:
        super().__init__(input_size, output_size, bias, gather_output)
        self.quant, self._mm = quant, _matmul_op(backend)
        if self.tp_size > 1:
            _check_split(self.output_size_per_partition, quant.block_n, "output rows")
        _fp8_params(self, self.output_size_per_partition, input_size, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(x, self.weight, self.weight_scale_inv, self.quant.block_shape)
        if self.bias is not None:
            y = y + self.bias
        return tp_all_gather(y, dim=-1) if self.gather_output else y


class Fp8MergedColumnParallelLinear(MergedColumnParallelLinear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool, quant: Fp8BlockConfig,
                 backend: str = "torch") -> None:
        super().__init__(input_size, output_sizes, bias)
        self.quant, self._mm = quant, _matmul_op(backend)
        for size in output_sizes:  # each part's scale rows must start on a tile boundary
            _check_split(size // self.tp_size, quant.block_n, "merged output part")
        _fp8_params(self, self.output_size_per_partition, input_size, quant)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if param is not self.weight_scale_inv:
            return super().weight_loader(param, loaded, shard_id)
        bn = self.quant.block_n
        if shard_id is None:
            offset = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded.narrow(0, offset // bn, size // bn), i)
                offset += size
            return
        rows = self.output_sizes[shard_id] // self.tp_size // bn
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size // bn
        src = loaded.narrow(0, self.tp_rank * rows, rows)
        if src.shape != param.data.narrow(0, offset, rows).shape:
            raise ValueError(f"fp8 scale of shape {tuple(loaded.shape)} does not fit {tuple(param.shape)}")
        param.data.narrow(0, offset, rows).copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(x, self.weight, self.weight_scale_inv, self.quant.block_shape)
        return y + self.bias if self.bias is not None else y


class Fp8RowParallelLinear(RowParallelLinear):
    def __init__(self, input_size: int, output_size: int, bias: bool, quant: Fp8BlockConfig,
                 backend: str = "torch", reduce_results: bool = True) -> None:
        super().__init__(input_size, output_size, bias, reduce_results)
        self.quant, self._mm = quant, _matmul_op(backend)
        if self.tp_size > 1:
            _check_split(self.input_size_per_partition, quant.block_k, "input columns")
        _fp8_params(self, output_size, self.input_size_per_partition, quant)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(x, self.weight, self.weight_scale_inv, self.quant.block_shape)
        if self.reduce_results:
            y = tp_all_reduce(y)
        return y + self.bias if self.bias is not None else y


def make_linear(kind: str, input_size: int, output_size: int | list[int], *, bias: bool = False,
                quant: Fp8BlockConfig | None = None, prefix: str = "", backend: str = "torch") -> nn.Module:
    """kind: replicated / column / merged (output_size is the list of parts) / row; fp8 when `quant` covers it."""
    fp8 = quant is not None and quant.applies_to(prefix)
    if kind == "merged":
        if not isinstance(output_size, list):
            raise TypeError("merged linear needs the list of output sizes")
        if fp8:
            return Fp8MergedColumnParallelLinear(input_size, output_size, bias, quant, backend)  # type: ignore[arg-type]
        return MergedColumnParallelLinear(input_size, output_size, bias)
    if not isinstance(output_size, int):
        raise TypeError(f"{kind} linear needs one output size")
    if kind == "replicated":
        return (Fp8ReplicatedLinear(input_size, output_size, bias, quant, backend) if fp8  # type: ignore[arg-type]
                else ReplicatedLinear(input_size, output_size, bias))
    if kind == "column":
        return (Fp8ColumnParallelLinear(input_size, output_size, bias, quant, backend) if fp8  # type: ignore[arg-type]
                else ColumnParallelLinear(input_size, output_size, bias))
    if kind == "row":
        return (Fp8RowParallelLinear(input_size, output_size, bias, quant, backend) if fp8  # type: ignore[arg-type]
                else RowParallelLinear(input_size, output_size, bias))
    raise ValueError(f"unknown linear kind {kind!r} (replicated, column, merged, row)")


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A linear layer's weight in float form (dequantized when it is fp8), for weight absorption."""
    w = linear.weight
    if w.dtype != FP8_DTYPE:
        return w
    quant: Fp8BlockConfig = linear.quant  # type: ignore[assignment]
    return dequantize_blocks(w, linear.weight_scale_inv, quant.block_shape)


# ---- online quantization: precision.quantization = "fp8" on a float checkpoint ------------------------------------

ONLINE_BLOCK = Fp8BlockConfig(128, 128)  # DeepSeek-V3's layout, so one kernel family serves both


def online_fp8_needed(quantization: str | None, hf_config: PretrainedConfig) -> bool:
    """True when the weights must be quantized after loading: fp8 asked for and the checkpoint is not fp8 already
    (then the setting only confirms the format). Any other requested scheme is an error here."""
    if quantization is None:
        return False
    if quantization != "fp8":
        raise ValueError(f"precision.quantization={quantization!r} is not supported (supported: fp8)")
    shipped = Fp8BlockConfig.from_hf(hf_config)  # raises for a checkpoint in another scheme
    return shipped is None


class Fp8QKVParallelLinear(QKVParallelLinear):
    """QKV's fp8 twin (only made by quantizing a loaded float layer: checkpoints in fp8 use make_linear)."""

    forward = Fp8ColumnParallelLinear.forward


# exact type -> its fp8 twin; each twin subclasses the plain layer, so loaders and TP attributes carry over
_TWINS: dict[type[nn.Module], type[nn.Module]] = {
    ReplicatedLinear: Fp8ReplicatedLinear, ColumnParallelLinear: Fp8ColumnParallelLinear,
    MergedColumnParallelLinear: Fp8MergedColumnParallelLinear, QKVParallelLinear: Fp8QKVParallelLinear,
    RowParallelLinear: Fp8RowParallelLinear,
}


def _quantized_param(w: torch.Tensor, quant: Fp8BlockConfig) -> tuple[nn.Parameter, nn.Parameter]:
    q, scale = block_quantize(w.data, quant.block_shape)
    return nn.Parameter(q, requires_grad=False), nn.Parameter(scale, requires_grad=False)


def quantize_model_fp8(model: nn.Module, backend: str = "torch", quant: Fp8BlockConfig = ONLINE_BLOCK) -> int:
    """Quantize every loaded float linear layer and expert stack to e4m3 with per-tile scales, in place, and
    switch them to the block-scaled GEMM; embeddings, the LM head, routers and norms stay in the model dtype
    (as vLLM's fp8 method does). Works on meta tensors too (the memory estimate). Returns the layers changed."""
    changed = 0
    for name, module in model.named_modules():
        twin = _TWINS.get(type(module))
        if twin is not None and module.weight.dtype != FP8_DTYPE and quant.applies_to(name):
            loader = getattr(module.weight, "weight_loader", None)
            module.weight, module.weight_scale_inv = _quantized_param(module.weight, quant)
            module.weight.weight_loader = loader  # type: ignore[attr-defined]
            # the weight is replaced in place, not re-made: keep the module (hooks, references), swap its forward
            module.__class__ = twin
            module.quant, module._mm = quant, _matmul_op(backend)
            changed += 1
        elif hasattr(module, "w13_weight") and module.quant is None:  # an expert stack (layers/moe.py FusedMoE)
            module.w13_weight, module.w13_weight_scale_inv = _quantized_param(module.w13_weight, quant)
            module.w2_weight, module.w2_weight_scale_inv = _quantized_param(module.w2_weight, quant)
            module.quant = quant
            changed += 1
    return changed
