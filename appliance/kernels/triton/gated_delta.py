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
from dataclasses import dataclass
from typing import Any

import torch

from appliance.kernels.registry import register
from appliance.kernels.step_cache import StepCache

# fla is looked for here but imported on the first call: its import costs seconds that a worker serving any other
# model must not pay at start-up (the registry imports this package with every Triton kernel)
HAVE_FLA = importlib.util.find_spec("fla") is not None


@functools.cache
def _fla() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """fla's (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


@dataclass(frozen=True)
class PrefillArgs:
    """A step's prefill sequences on the device: the same tensors for every linear-attention layer of the step."""

    cu_seqlens: torch.Tensor  # [B + 1] int64
    slots: torch.Tensor  # [B] int64
    fresh: torch.Tensor  # [B] bool


_ARGS = StepCache()  # keyed by the step's host lists (SequenceStates), which every layer passes


def prefill_args(cu_seqlens: list[int], slots: list[int], fresh: list[bool], device: torch.device) -> PrefillArgs:
    """The first layer of a step uploads them in one non-blocking copy from pinned memory; the others reuse them.
    A pageable upload per argument and layer held the host until the device caught up (three times in each
    linear-attention layer), and a new cu_seqlens tensor per layer made fla rebuild its chunk indices, which
    it caches per tensor and reads on the host (one more wait)."""
    return _ARGS.get((cu_seqlens, slots, fresh), device, lambda: _upload(cu_seqlens, slots, fresh, device))


def _upload(cu_seqlens: list[int], slots: list[int], fresh: list[bool], device: torch.device) -> PrefillArgs:
    if len(cu_seqlens) != len(slots) + 1 or len(fresh) != len(slots):
        raise ValueError(f"{len(slots)} prefill slots need {len(slots) + 1} offsets and as many fresh flags; got "
                         f"{len(cu_seqlens)} and {len(fresh)}")
    host = torch.tensor([*cu_seqlens, *slots, *(int(f) for f in fresh)], dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()  # the caching host allocator keeps the block until the copy is done
    flat = host.to(device, non_blocking=True)
    b = len(slots)
    return PrefillArgs(flat[: b + 1], flat[b + 1: 2 * b + 1], flat[2 * b + 1:].bool())


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
    args = prefill_args(cu_seqlens, slots, fresh, v.device)
    init = _initial(states, args.slots, args.fresh)
    q, k = _grouped(q, k, v.shape[-2])
    chunk_gated_delta_rule, _ = _fla()
    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None], scale=q.shape[-1] ** -0.5,
                                      initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=args.cu_seqlens)
    states.index_copy_(0, args.slots, final.to(states.dtype))
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
