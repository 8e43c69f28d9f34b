"""The gated delta rule on the GPU through flash-linear-attention (fla-core), the field's Triton kernels for
Gated DeltaNet: its chunked kernel for prefill (varlen over cu_seqlens, initial states gathered from the
requests' slots) and its fused recurrent kernel for decode, registered under "triton" when fla imports (the
optional `hybrid` extra). Without it the layers fall back to the torch reference (kernels/reference/gated_delta.py),
which is also the oracle: tests/test_gated_delta.py checks fla against it on a GPU. The short convolution keeps the
torch version (one small depthwise conv per layer; fla's causal-conv kernels would add a second state layout).
"""
from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import torch

from appliance.kernels.registry import register

# fla is looked for here but imported on the first call: its import costs seconds that a worker serving any other
# model must not pay at start-up (the registry imports this package with every Triton kernel)
HAVE_FLA = importlib.util.find_spec("fla") is not None


@functools.cache
def _fla() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """fla's (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _grouped(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    rep = hv // q.shape[-2]
    return (q.repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)) if rep > 1 else (q, k)


def _initial(states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The rows' states in float32 (the kernels' accumulation type, whatever cache.ssm_state_dtype stores)."""
    return states.index_select(0, slots).float() * (~fresh).float()[:, None, None, None]


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        cu_seqlens: list[int], states: torch.Tensor, slots: list[int], fresh: list[bool],
                        chunk: int = 64) -> torch.Tensor:
    """kernels/reference/gated_delta.py's gated_delta_prefill (chunk: fla's own, 64)."""
    dev = v.device
    slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
    init = _initial(states, slots_t, torch.tensor(fresh, dtype=torch.bool, device=dev))
    q, k = _grouped(q, k, v.shape[-2])
    chunk_gated_delta_rule, _ = _fla()
    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None], scale=q.shape[-1] ** -0.5,
                                      initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int64, device=dev))
    states.index_copy_(0, slots_t, final.to(states.dtype))
    return o[0].to(v.dtype)


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """kernels/reference/gated_delta.py's gated_delta_decode: one token per row, no host sync."""
    q, k = _grouped(q, k, v.shape[-2])
    _, fused_recurrent_gated_delta_rule = _fla()
    o, final = fused_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None].float(),
                                                beta=beta[:, None], scale=q.shape[-1] ** -0.5,
                                                initial_state=_initial(states, slots, fresh),
                                                output_final_state=True, use_qk_l2norm_in_kernel=True)
    states.index_copy_(0, slots, final.to(states.dtype))
    return o[:, 0].to(v.dtype)


if HAVE_FLA:
    register("gated_delta_prefill", "triton")(gated_delta_prefill)
    register("gated_delta_decode", "triton")(gated_delta_decode)
