"""Mixture-of-experts layers: the router (expert selection), the stacked experts and the sparse block.

Routing flavours (select_experts):
- softmax top-k, optionally renormalized (Mixtral always, Qwen2/3-MoE with norm_topk_prob);
- softmax with group-limited top-k (DeepSeek-V2 `group_limited_greedy`: groups ranked by their best expert);
- sigmoid scores + e_score_correction_bias for the choice only, groups ranked by the sum of their top-2 biased
  scores (DeepSeek-V3 `noaux_tc`); the weights are the unbiased scores of the chosen experts.
Then weights are scaled by routed_scaling_factor. Experts are stacked [E, ...] for the fused kernel
(op "fused_moe"); under tensor parallelism each rank holds a slice of every expert's intermediate dimension.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import appliance.kernels.moe  # noqa: F401  (registers the fused_moe kernels)
from appliance.kernels import registry
from appliance.layers.activation import SiluAndMul
from appliance.layers.fp8 import FP8_DTYPE, Fp8BlockConfig, make_linear
from appliance.layers.kernels import kernel
from appliance.layers.parallel_state import (
    divide,
    get_ep_rank,
    get_ep_size,
    get_tp_rank,
    get_tp_size,
    tp_all_reduce,
)


def resolve_moe_backend(name: str, attention_backend: str) -> str:
    """backends.moe: `auto` follows the resolved attention backend where it has fused_moe (else torch); a named
    backend must have it."""
    if name == "auto":
        return attention_backend if attention_backend in registry.backends("fused_moe") else "torch"
    try:
        registry.get("fused_moe", name)
    except (KeyError, ImportError) as exc:
        raise ValueError(f"backends.moe = {name!r} is not available here: {exc}") from exc
    return name


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax"  # softmax / sigmoid
    renormalize: bool = False
    num_groups: int = 1  # expert groups for group-limited routing (1: none)
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"router scoring {self.scoring!r} is not softmax or sigmoid")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be within 1..{self.num_experts} experts")
        if self.num_experts % self.num_groups or not 1 <= self.topk_groups <= self.num_groups:
            raise ValueError(f"{self.num_experts} experts cannot be routed in {self.num_groups} groups "
                             f"choosing {self.topk_groups}")


def _group_mask(choice: torch.Tensor, cfg: RouterConfig, group_score: str) -> torch.Tensor:
    """[T, E] bool: experts inside the topk_groups best groups of each token."""
    grouped = choice.view(choice.shape[0], cfg.num_groups, -1)
    if group_score == "max":
        scores = grouped.max(dim=-1).values
    else:  # sum of the two best experts of each group
        scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    best = scores.topk(cfg.topk_groups, dim=-1, sorted=False).indices
    mask = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, best, True)
    return mask.unsqueeze(-1).expand_as(grouped).reshape_as(choice)


def select_experts(logits: torch.Tensor, cfg: RouterConfig,
                   correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, K] float32, expert ids [T, K] int64)."""
    if cfg.scoring == "softmax":
        if correction_bias is not None:
            raise ValueError("e_score_correction_bias is only defined for sigmoid scoring")
        scores = logits.softmax(dim=-1, dtype=torch.float32)  # casts first: one op, the same values
        choice = scores
        if cfg.num_groups > 1:
            choice = scores.masked_fill(~_group_mask(scores, cfg, "max"), 0.0)
    else:
        scores = logits.float().sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias.float()
        if cfg.num_groups > 1:
            choice = choice.masked_fill(~_group_mask(choice, cfg, "top2"), float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if cfg.renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if cfg.scoring == "sigmoid" else total)
    if cfg.routed_scaling_factor != 1.0:
        weights = weights * cfg.routed_scaling_factor
    return weights, ids


class Router(nn.Module):
    """The gate: a replicated [E, H] projection (kept in float32 for sigmoid routing, as DeepSeek-V3 does)."""

    def __init__(self, hidden_size: int, cfg: RouterConfig, correction_bias: bool = False) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden_size), requires_grad=False)
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32),
                                                        requires_grad=False)
        else:
            self.register_parameter("e_score_correction_bias", None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.cfg.scoring == "sigmoid":
            logits = F.linear(x.float(), self.weight.float())
        else:
            logits = F.linear(x, self.weight)
        return select_experts(logits, self.cfg, self.e_score_correction_bias)


# checkpoint projection name -> our stacked tensor and shard
EXPERT_SHARDS = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
                 "w2": ("w2", None), "down_proj": ("w2", None)}
EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>w1|w2|w3|gate_proj|up_proj|down_proj)"
                         r"\.(?P<kind>weight|weight_scale_inv|weight_scale|input_scale)$")
FUSED_EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


class FusedMoE(nn.Module):
    """All experts of one layer stacked: w13_weight [E, 2I, H] (gate rows then up rows), w2_weight [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, quant: Fp8BlockConfig | None = None,
                 backend: str = "torch", reduce_results: bool = True) -> None:
        super().__init__()
        # expert parallelism (ep = tp): this rank holds experts [expert_start, +num_local) whole, computes only
        # their share of each token and the block's all-reduce sums the ranks; else every expert, tensor-split
        self.ep_rank, self.ep_size = get_ep_rank(), get_ep_size()
        self.tp_rank, self.tp_size = (0, 1) if self.ep_size > 1 else (get_tp_rank(), get_tp_size())
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.num_local = divide(num_experts, self.ep_size)
        self.expert_start = self.ep_rank * self.num_local
        self.intermediate = divide(intermediate_size, self.tp_size)
        self.reduce_results, self.quant = reduce_results, quant
        dtype = FP8_DTYPE if quant is not None else None
        n = self.num_local
        self.w13_weight = nn.Parameter(torch.empty(n, 2 * self.intermediate, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(n, hidden_size, self.intermediate, dtype=dtype),
                                      requires_grad=False)
        if quant is not None:
            bn, bk = quant.block_shape
            if self.intermediate % bn or self.intermediate % bk:
                raise ValueError(f"fp8 experts: intermediate size {self.intermediate} per rank is not a multiple of "
                                 f"the {bn}x{bk} scale tiles")
            self.w13_weight_scale_inv = nn.Parameter(
                torch.empty(n, 2 * self.intermediate // bn, -(-hidden_size // bk), dtype=torch.float32),
                requires_grad=False)
            self.w2_weight_scale_inv = nn.Parameter(
                torch.empty(n, -(-hidden_size // bn), self.intermediate // bk, dtype=torch.float32),
                requires_grad=False)
        else:
            self.register_parameter("w13_weight_scale_inv", None)
            self.register_parameter("w2_weight_scale_inv", None)
        # per-row scales [E, 2I] / [E, H] of per-tensor / per-channel fp8 experts (layers/fp8_scaled.py sets them)
        self.register_parameter("w13_weight_scale", None)
        self.register_parameter("w2_weight_scale", None)
        self._op = kernel("fused_moe", backend)

    def load_row_scale(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, shard: int | None) -> None:
        """One expert's per-tensor ([1]) or per-channel ([N] / [N, 1]) scale of a gate / up / down weight into
        this rank's rows: gate and up rows are split over tensor-parallel ranks like their weights, down's rows
        (the hidden size) are whole on every rank."""
        expert -= self.expert_start
        if not 0 <= expert < self.num_local:
            return
        t = loaded.float().reshape(-1)
        rows = self.hidden_size if shard is None else self.intermediate * self.tp_size
        if t.numel() == 1:
            t = t.expand(rows)
        if t.numel() != rows:
            raise ValueError(f"expert scale of {t.numel()} values fits neither one tensor nor {rows} rows")
        dst = param.data[expert]
        if shard is not None:
            dst = dst.narrow(0, shard * self.intermediate, self.intermediate)
            t = t.narrow(0, self.tp_rank * self.intermediate, self.intermediate)
        dst.copy_(t)

    def load_expert(self, param: nn.Parameter, loaded: torch.Tensor, expert: int, shard: int | None) -> None:
        """One checkpoint tensor of one expert (a gate/up/down weight or its fp8 scale) into this rank's slice.

        shard 0 / 1: gate / up, [I, H] split along I into that half of w13; None: down, [H, I] split along I.
        Scales are split the same way in units of their tiles.
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} outside 0..{self.num_experts - 1}")
        if param is self.w13_weight_scale or param is self.w2_weight_scale:
            return self.load_row_scale(param, loaded, expert, shard)
        expert -= self.expert_start
        if not 0 <= expert < self.num_local:
            return  # another expert-parallel rank's expert
        dim = 1 if shard is None else 0
        unit = 1
        if param is self.w13_weight_scale_inv or param is self.w2_weight_scale_inv:
            unit = self.quant.block_k if shard is None else self.quant.block_n  # type: ignore[union-attr]
        size = self.intermediate // unit
        dst = param.data[expert]
        if shard is not None:
            dst = dst.narrow(0, shard * size, size)
        expected = list(dst.shape)
        expected[dim] = size * self.tp_size
        if list(loaded.shape) != expected:
            raise ValueError(f"expert tensor of shape {tuple(loaded.shape)} does not fit {tuple(expected)}")
        dst.copy_(loaded.narrow(dim, self.tp_rank * size, size))

    def load_fused(self, proj: str, loaded: torch.Tensor) -> None:
        """transformers' 3-D layout: gate_up_proj [E, 2I, H] or down_proj [E, H, I] (full, unsharded)."""
        for e in range(self.expert_start, self.expert_start + self.num_local):
            if proj == "down_proj":
                self.load_expert(self.w2_weight, loaded[e], e, None)
            else:
                gate, up = loaded[e].chunk(2, dim=0)
                self.load_expert(self.w13_weight, gate, e, 0)
                self.load_expert(self.w13_weight, up, e, 1)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        block = self.quant.block_shape if self.quant is not None else None
        if self.ep_size > 1:  # other ranks' experts weigh 0 here (computed on local expert 0, then dropped)
            local = topk_ids - self.expert_start
            mine = (local >= 0) & (local < self.num_local)
            topk_ids = torch.where(mine, local, torch.zeros_like(local))
            topk_weights = torch.where(mine, topk_weights, torch.zeros_like(topk_weights))
        if self.w13_weight_scale is not None:  # per-row fp8 scales
            out = self._op(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.w13_weight_scale,
                           self.w2_weight_scale, None)
        else:
            out = self._op(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                           self.w13_weight_scale_inv, self.w2_weight_scale_inv, block)
        return tp_all_reduce(out) if self.reduce_results else out


class GatedMLP(nn.Module):
    """down(silu(gate x) * up x): dense layers and shared experts (gate_up_proj fused, fp8 when quantized)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu",
                 quant: Fp8BlockConfig | None = None, prefix: str = "", backend: str = "torch",
                 reduce_results: bool = True) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = make_linear("merged", hidden_size, [intermediate_size, intermediate_size], quant=quant,
                                        prefix=f"{prefix}.gate_up_proj", backend=backend)
        self.down_proj = make_linear("row", intermediate_size, hidden_size, quant=quant,
                                     prefix=f"{prefix}.down_proj", backend=backend)
        self.down_proj.reduce_results = reduce_results
        self.act = SiluAndMul(backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class SparseMoeBlock(nn.Module):
    """Routed experts plus optional shared experts (always on; Qwen2-MoE scales them by a sigmoid gate).

    Attribute names follow the checkpoints: `gate` (router), `experts`, and `shared_name` for the shared MLP
    (`shared_experts` in DeepSeek, `shared_expert` + `shared_expert_gate` in Qwen2-MoE).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, router: RouterConfig, *,
                 correction_bias: bool = False, shared: GatedMLP | None = None, shared_name: str = "shared_experts",
                 shared_gate: bool = False, quant: Fp8BlockConfig | None = None, backend: str = "torch",
                 moe_backend: str | None = None) -> None:
        super().__init__()
        self.gate = Router(hidden_size, router, correction_bias)
        # one all-reduce for routed + shared partial sums
        self.experts = FusedMoE(router.num_experts, hidden_size, intermediate_size, quant, moe_backend or backend,
                                reduce_results=False)
        self.shared_name = shared_name if shared is not None else None
        if shared is not None:
            shared.down_proj.reduce_results = False
            setattr(self, shared_name, shared)
        self.shared_expert_gate = ReplicatedGate(hidden_size) if shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return tp_all_reduce(out)


class ReplicatedGate(nn.Module):
    """Qwen2-MoE's scalar gate on the shared expert: [1, H] weight, replicated."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
