"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5, over the state cache.

x -> in_proj_qkvz, in_proj_ba (Qwen3-Next: grouped per key head) or in_proj_qkv, _z, _b, _a (Qwen3.5: one
projection each, heads in order) -> q, k, v through a depthwise causal
convolution + SiLU -> the gated delta rule (decay g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b)) ->
an RMSNorm of each value head gated by SiLU(z) -> out_proj. Decode rows (one token) take the recurrent update,
prefill chunks the chunked form; both read and write the request's state slot (layers/attention.py
`SequenceStates`), so chunked prefill carries the state from chunk to chunk.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from appliance.layers.attention import AttentionMetadata
from appliance.layers.kernels import kernel
from appliance.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from appliance.layers.parallel_state import get_tp_rank, get_tp_size


@dataclass(frozen=True)
class StateCacheSpec:
    """The state shapes of one linear-attention layer (on this rank) and how many layers have them."""

    num_layers: int
    conv_dim: int  # channels of the short convolution
    conv_width: int  # kernel size - 1: the inputs a request's convolution remembers
    num_heads: int  # value heads of the recurrent state
    key_dim: int
    value_dim: int
    conv_dtype: torch.dtype
    state_dtype: torch.dtype = torch.float32  # the recurrent state accumulates over the whole sequence

    @property
    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * self.conv_width * _size(self.conv_dtype)
        state = self.num_heads * self.key_dim * self.value_dim * _size(self.state_dtype)
        return self.num_layers * (conv + state)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim (weight, not 1 + weight) times SiLU(gate), in float32 like transformers (op
    "gated_rms_norm": one launch on the Triton backend)."""

    def __init__(self, dim: int, eps: float, backend: str = "torch") -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps
        self._op = kernel("gated_rms_norm", backend)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self._op(x, gate, self.weight, self.eps)


def _rank_rows(loaded: torch.Tensor, parts: list[int]) -> torch.Tensor:
    """This rank's share of each consecutive part of dim 0 (each split evenly over the ranks), concatenated."""
    rank, size = get_tp_rank(), get_tp_size()
    out, at = [], 0
    for n in parts:
        out.append(loaded.narrow(0, at + rank * (n // size), n // size))
        at += n
    return torch.cat(out)


def _sharded(param: nn.Parameter, parts: list[int]) -> nn.Parameter:
    """Give param a loader that keeps this rank's rows of each part (tensor parallelism splits heads)."""

    def load(p: nn.Parameter, loaded: torch.Tensor) -> None:
        shard = _rank_rows(loaded, parts)
        if shard.shape != p.shape:
            raise ValueError(f"checkpoint tensor of shape {tuple(loaded.shape)} does not fit {tuple(p.shape)} "
                             f"x {get_tp_size()} ranks")
        p.data.copy_(shard)

    param.weight_loader = load  # type: ignore[attr-defined]
    return param


class ConvWeight(nn.Module):
    """The depthwise convolution's weight in the checkpoint's shape [C, 1, K] (no bias); its channels are the q, k
    and v heads in order, each part split over the ranks."""

    def __init__(self, parts: list[int], kernel_size: int) -> None:
        super().__init__()
        channels = sum(parts) // get_tp_size()
        self.weight = _sharded(nn.Parameter(torch.empty(channels, 1, kernel_size), requires_grad=False), parts)


class GatedDeltaNet(nn.Module):
    """Tensor parallelism splits the key and value heads over the ranks (each rank's value heads stay with their
    key head); every size below is this rank's, the state cache's slots hold this rank's heads."""

    def __init__(self, cfg: Any, backend: str, split_projections: bool = False) -> None:
        super().__init__()
        tp, hk, hv = get_tp_size(), cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if hk % tp or hv % tp:
            raise ValueError(f"tensor parallelism {tp} must divide the linear-attention heads ({hk} key, {hv} value)")
        self.num_k_heads, self.num_v_heads = hk // tp, hv // tp
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = cfg.linear_conv_kernel_dim
        hidden = cfg.hidden_size
        qkv = [tp * self.key_dim, tp * self.key_dim, tp * self.value_dim]  # the checkpoint's q, k, v parts
        self.split_projections = split_projections
        if split_projections:
            self.in_proj_qkv = MergedColumnParallelLinear(hidden, qkv)
            self.in_proj_z = ColumnParallelLinear(hidden, tp * self.value_dim)
            self.in_proj_b = ColumnParallelLinear(hidden, hv)
            self.in_proj_a = ColumnParallelLinear(hidden, hv)
        else:  # grouped per key head: a contiguous split keeps whole key-head groups
            self.in_proj_qkvz = ColumnParallelLinear(hidden, tp * (2 * self.key_dim + 2 * self.value_dim))
            self.in_proj_ba = ColumnParallelLinear(hidden, 2 * hv)
        self.conv1d = ConvWeight(qkv, self.conv_kernel_size)
        self.dt_bias = _sharded(nn.Parameter(torch.ones(self.num_v_heads), requires_grad=False), [hv])
        self.A_log = _sharded(nn.Parameter(torch.zeros(self.num_v_heads), requires_grad=False), [hv])
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps, backend)
        self.out_proj = RowParallelLinear(tp * self.value_dim, hidden)
        self._prefill = kernel("gated_delta_prefill", backend)
        self._decode = kernel("gated_delta_decode", backend)
        self._conv = kernel("causal_conv1d", backend)
        self._conv_decode = kernel("causal_conv1d_decode", backend)
        self._gates = kernel("gdn_gating", backend)
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def bind_state_cache(self, conv_state: torch.Tensor | None, ssm_state: torch.Tensor | None) -> None:
        self.conv_state, self.ssm_state = conv_state, ssm_state

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Mixed qkv [T, conv_dim] (q, k, v heads in order); z [T, Hv, Dv], b and a [T, Hv], or for Qwen3-Next's
        grouped projections z [T, Hk, G * Dv], b and a [T, Hk, G] (views: the gate and norm ops read them in
        place, value head h = kh * G + j)."""
        if self.split_projections:
            z = self.in_proj_z(x).view(x.shape[0], self.num_v_heads, self.head_v_dim)
            return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)
        qkvz, ba = self.in_proj_qkvz(x), self.in_proj_ba(x)
        # undo Qwen3-Next's grouping of q, k and v per key head: the convolution's channels are q, k, v in order
        t, hk, group = qkvz.shape[0], self.num_k_heads, self.num_v_heads // self.num_k_heads
        q, k, v, z = qkvz.view(t, hk, -1).split([self.head_k_dim, self.head_k_dim, group * self.head_v_dim,
                                                 group * self.head_v_dim], dim=-1)
        b, a = ba.view(t, hk, 2 * group).split([group, group], dim=-1)
        mixed = qkvz.new_empty(t, self.conv_dim)
        for part, dst in zip((q, k, v), mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)):
            dst.view(part.shape).copy_(part)
        return mixed, z, b, a

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.conv_state is None or self.ssm_state is None:
            raise RuntimeError("GatedDeltaNet has no state cache bound (ModelRunner binds one per layer)")
        states = meta.states
        if states is None:
            raise RuntimeError("a hybrid model's step needs state slots (build_inputs(..., with_states=True))")
        t, nd = x.shape[0], meta.num_decode_tokens
        mixed, z, b, a = self._project(x)
        weight = self.conv1d.weight[:, 0, :]
        fresh_d = positions[:nd] == 0 if nd else None
        conv_out = _by_rows(nd, t, mixed, lambda: self._conv_decode(
            mixed[:nd], weight, self.conv_state, states.decode_slots, fresh_d), lambda: self._conv(
            mixed[nd:], weight, states.prefill_cu_seqlens, self.conv_state, states.prefill_slots,
            states.prefill_fresh))
        q, k, v = conv_out.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.view(t, self.num_k_heads, self.head_k_dim), k.view(t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)
        g, beta = self._gates(a, b, self.A_log, self.dt_bias)
        out = _by_rows(nd, t, v, lambda: self._decode(
            q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], self.ssm_state, states.decode_slots, fresh_d),
            lambda: self._prefill(q[nd:], k[nd:], v[nd:], g[nd:], beta[nd:], states.prefill_cu_seqlens,
                                  self.ssm_state, states.prefill_slots, states.prefill_fresh))
        out = self.norm(out, z).reshape(t, self.value_dim)
        return self.out_proj(out)


def _by_rows(nd: int, t: int, like: torch.Tensor, decode: Callable[[], torch.Tensor],
             prefill: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Rows [0, nd) from decode(), rows [nd, t) from prefill(): a step of one kind takes its op's output as it is
    (no buffer, no copy into it), a mixed step fills a buffer shaped like `like`."""
    if nd == 0:
        return prefill()
    if nd == t:
        return decode()
    out = torch.empty_like(like)
    out[:nd] = decode()
    out[nd:] = prefill()
    return out
