"""The gated delta rule on the GPU through flash-linear-attention (fla-core), the field's Triton kernels for
Gated DeltaNet: its chunked kernel for prefill (varlen over cu_seqlens, initial states gathered from the
requests' slots) and its fused recurrent kernel for decode, registered under "triton" when fla imports (the
optional `hybrid` extra). Without it the layers fall back to the torch reference (kernels/reference/gated_delta.py),
which is also the oracle: tests/test_gated_delta.py checks fla against it on a GPU. The short convolution has its
own Triton kernels (triton/causal_conv.py, over the same per-step uploads; fla's would add a second state layout).
Needs fla-core 0.6 or later (the `hybrid` extra's): q and k with fewer heads than v, and chunk indices passed in.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
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

    if "chunk_indices" not in inspect.signature(chunk_gated_delta_rule).parameters:
        raise ImportError("the installed fla-core predates 0.6, whose chunked gated delta rule takes chunk indices "
                          "and fewer key than value heads: pip install 'fla-core>=0.6' (the hybrid extra)")
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


@dataclass(frozen=True)
class PrefillArgs:
    """A step's prefill sequences on the device: the same tensors for every linear-attention layer of the step."""

    cu_seqlens: torch.Tensor  # [B + 1] int64
    slots: torch.Tensor  # [B] int64
    keep: torch.Tensor  # [B, 1, 1, 1] float32: 0 where the sequence starts from zero state, else 1
    chunk_indices: torch.Tensor  # [chunks, 2] int64: (sequence, chunk within it) of every 64-token chunk


_ARGS = StepCache()  # keyed by the step's host lists (SequenceStates), which every layer passes
CHUNK = 64  # fla's chunk of the chunked form (its chunk_gated_delta_rule default)


def prefill_args(cu_seqlens: list[int], slots: list[int], fresh: list[bool], device: torch.device) -> PrefillArgs:
    """The first layer of a step uploads them in one non-blocking copy from pinned memory; the others reuse them.
    A pageable upload per argument and layer held the host until the device caught up (three times in each
    linear-attention layer), and fla derives its chunk indices from a device cu_seqlens by reading a sum back to
    the host (a wait for the device, once per step): they are built here from the host list instead."""
    return _ARGS.get((cu_seqlens, slots, fresh), device, lambda: _upload(cu_seqlens, slots, fresh, device))


def chunk_indices(cu_seqlens: list[int], chunk: int = CHUNK) -> list[int]:
    """fla's prepare_chunk_indices on the host, flattened: (sequence, chunk) for every chunk of every sequence."""
    return [v for i in range(len(cu_seqlens) - 1)
            for c in range(-(-(cu_seqlens[i + 1] - cu_seqlens[i]) // chunk)) for v in (i, c)]


def _upload(cu_seqlens: list[int], slots: list[int], fresh: list[bool], device: torch.device) -> PrefillArgs:
    if len(cu_seqlens) != len(slots) + 1 or len(fresh) != len(slots):
        raise ValueError(f"{len(slots)} prefill slots need {len(slots) + 1} offsets and as many fresh flags; got "
                         f"{len(cu_seqlens)} and {len(fresh)}")
    host = torch.tensor([*cu_seqlens, *slots, *(int(not f) for f in fresh), *chunk_indices(cu_seqlens)],
                        dtype=torch.int64)
    if device.type == "cuda":
        host = host.pin_memory()  # the caching host allocator keeps the block until the copy is done
    flat = host.to(device, non_blocking=True)
    b = len(slots)
    keep = flat[2 * b + 1: 3 * b + 1].float().view(b, 1, 1, 1)
    return PrefillArgs(flat[: b + 1], flat[b + 1: 2 * b + 1], keep, flat[3 * b + 1:].view(-1, 2))


def _initial(states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """The rows' states in float32 (the kernels' accumulation type, whatever cache.ssm_state_dtype stores)."""
    return states.index_select(0, slots).float() * (~fresh).float()[:, None, None, None]


def gated_delta_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        cu_seqlens: list[int], states: torch.Tensor, slots: list[int], fresh: list[bool],
                        chunk: int = CHUNK) -> torch.Tensor:
    """kernels/reference/gated_delta.py's gated_delta_prefill (chunk: fla's own, 64). q and k keep their key
    heads: fla's kernels share each key head among its value heads (grouped value attention)."""
    if chunk != CHUNK:
        raise ValueError(f"fla's chunked gated delta rule runs {CHUNK}-token chunks, not {chunk}")
    args = prefill_args(cu_seqlens, slots, fresh, v.device)
    init = None  # every sequence fresh: fla starts them from zero state
    if not all(fresh):
        init = states.index_select(0, args.slots).float()
        init = init * args.keep if any(fresh) else init  # fresh sequences start from zero
    chunk_gated_delta_rule, _ = _fla()
    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None], scale=q.shape[-1] ** -0.5,
                                      initial_state=init, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                      cu_seqlens=args.cu_seqlens, chunk_indices=args.chunk_indices)
    states.index_copy_(0, args.slots, final.to(states.dtype))
    return o[0].to(v.dtype)


def gated_delta_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """kernels/reference/gated_delta.py's gated_delta_decode: one token per row, no host sync; key heads shared
    by their value heads inside the kernel, as in prefill."""
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
