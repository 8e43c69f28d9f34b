"""The state cache of hybrid models, beside the paged KV cache: per linear-attention layer, one recurrent state
and one short-convolution state per request slot.

A linear-attention layer keeps a fixed-size state per request instead of a growing KV cache. Slots are the
rows of the runner's device block table (request_table.py): a request gets its row, and so its state slot, when
the worker first sees it and gives it back when it is finished, aborted or preempted, so the state cache can
neither leak nor be shared. Row 0 is the scratch slot of padding rows and of steps without request rows.
A preempted request is recomputed from its first token (its new slot starts from zero state).

Memory: the runner allocates the state cache before it profiles the model, so the profiled peak, and with it
the KV budget under cache.gpu_memory_utilization, counts it (executor/memory_profile.py).
"""
from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from appliance.engine.config import snapshot_slots
from appliance.executor.memory_check import GIB
from appliance.layers.gated_delta_net import StateCacheSpec

if TYPE_CHECKING:
    from collections.abc import Mapping

    from appliance.engine.step import StepPlan
    from appliance.executor.model_runner import ModelRunner
    from appliance.executor.request_table import RequestState

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StateCache:
    """The allocated states: conv [layers, slots, conv_dim, conv_width] and ssm [layers, slots, H, Dk, Dv], one
    tensor each, so a snapshot saved or restored is one copy per kind for every layer at once (a step's host
    time, not its device time, bounds a prefix hit's turn); `tensors` holds each layer's views of them."""

    spec: StateCacheSpec
    num_slots: int  # request slots, the scratch slot 0 not counted
    num_snapshots: int  # snapshot slots, rows after the request slots (engine/state_snapshots.py)
    conv: torch.Tensor
    ssm: torch.Tensor

    @property
    def tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (conv [slots, conv_dim, conv_width], ssm [slots, H, Dk, Dv]): views of the stacked tensors."""
        return list(zip(self.conv.unbind(0), self.ssm.unbind(0)))

    @property
    def nbytes(self) -> int:
        return (self.num_slots + 1 + self.num_snapshots) * self.spec.bytes_per_slot

    def snapshot_row(self, slot: int) -> int:
        if not 0 <= slot < self.num_snapshots:
            raise ValueError(f"state snapshot slot {slot} outside 0..{self.num_snapshots - 1}")
        return self.num_slots + 1 + slot

    def copy(self, src: int, dst: int) -> None:
        """Copy every layer's states from row src to row dst (a snapshot saved or restored)."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.ssm[:, dst].copy_(self.ssm[:, src])

    def save(self, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of every layer's states in these rows (a speculative step's, before its verification)."""
        index = torch.tensor(rows, dtype=torch.int64, device=self.conv.device)
        return self.conv.index_select(1, index), self.ssm.index_select(1, index)

    def restore(self, rows: list[int], saved: tuple[torch.Tensor, torch.Tensor], picks: list[int]) -> None:
        """Write saved[picks[i]] (rows of a `save`) back into row rows[i] of every layer."""
        device = self.conv.device
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        pick = torch.tensor(picks, dtype=torch.int64, device=device)
        conv_s, ssm_s = saved
        self.conv.index_copy_(1, index, conv_s.index_select(1, pick))
        self.ssm.index_copy_(1, index, ssm_s.index_select(1, pick))

    def describe(self) -> str:
        return (f"state cache: {self.spec.num_layers} linear-attention layers x {self.num_slots} slots "
                f"+ {self.num_snapshots} snapshot slots, "
                f"{self.spec.bytes_per_slot / 2**20:.2f} MiB per slot, {self.nbytes / GIB:.3f} GiB")


def _snapshots(cache: StateCache | None) -> StateCache:
    if cache is None:
        raise ValueError("the plan restores or saves a state snapshot, but the model keeps no recurrent state")
    return cache


def restore_snapshots(cache: StateCache | None, plan: StepPlan, requests: Mapping[str, RequestState]) -> None:
    """Prefix hits of a hybrid model: each new request's state at its hit's end, before the step."""
    for new in plan.new_requests:
        if new.restore_snapshot >= 0:
            sc = _snapshots(cache)
            sc.copy(sc.snapshot_row(new.restore_snapshot), requests[new.request_id].table_row)


def save_snapshots(cache: StateCache | None, plan: StepPlan, requests: Mapping[str, RequestState]) -> None:
    """After the step: the states of chunks that ended at a checkpoint (engine/state_snapshots.py)."""
    for s in plan.scheduled:
        if s.save_snapshot >= 0:
            sc = _snapshots(cache)
            sc.copy(requests[s.request_id].table_row, sc.snapshot_row(s.save_snapshot))


def allocate(spec: StateCacheSpec, num_slots: int, device: torch.device, num_snapshots: int = 0) -> StateCache:
    rows = num_slots + 1 + num_snapshots
    conv = torch.zeros(spec.num_layers, rows, spec.conv_dim, spec.conv_width, dtype=spec.conv_dtype, device=device)
    ssm = torch.zeros(spec.num_layers, rows, spec.num_heads, spec.key_dim, spec.value_dim, dtype=spec.state_dtype,
                      device=device)
    return StateCache(spec, num_slots, num_snapshots, conv, ssm)


def release(cache: StateCache) -> None:
    """Give the memory back now (the runner's finalizer; see kv_cache.release for why storage is emptied)."""
    for t in (cache.conv, cache.ssm):
        t.untyped_storage().resize_(0)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_HYBRID_ONLY = {"ssm_cache_slots": None, "ssm_checkpoint_interval": None, "ssm_cache_dtype": "auto",
                "ssm_state_dtype": "auto"}  # cache keys and their values that ask nothing of other models


def state_dtypes(cache: Any, model_dtype: torch.dtype, hf_config: Any) -> tuple[torch.dtype, torch.dtype]:
    """(convolution states, recurrent states) of cache.ssm_cache_dtype / cache.ssm_state_dtype: the convolution
    follows the model's dtype unless set; the recurrent state follows ssm_cache_dtype when that is set, else the
    checkpoint config's mamba_ssm_dtype (Qwen3.5 names float32), else float32, as it accumulates over the sequence."""
    conv = _DTYPES.get(cache.ssm_cache_dtype, model_dtype)
    name = cache.ssm_state_dtype
    if name == "auto":
        name = cache.ssm_cache_dtype if cache.ssm_cache_dtype != "auto" else getattr(hf_config, "mamba_ssm_dtype",
                                                                                    None)
    if name is not None and name not in _DTYPES:
        raise ValueError(f"the model config's mamba_ssm_dtype {name!r} is not one of {sorted(_DTYPES)}; set "
                         "cache.ssm_state_dtype")
    return conv, _DTYPES[name] if name is not None else torch.float32


def make_state_cache(runner: ModelRunner, num_slots: int) -> StateCache | None:
    """The runner's state cache, bound to its layers (None: the model keeps no recurrent state)."""
    layers = getattr(runner.model, "state_layers", lambda: [])()
    c = runner.config.cache
    if not layers:
        for key, unset in _HYBRID_ONLY.items():
            if getattr(c, key) != unset:
                raise ValueError(f"cache.{key} applies to hybrid linear-attention models; "
                                 f"{type(runner.model).__name__} keeps no recurrent state")
        return None
    snapshots = snapshot_slots(runner.config) if c.enable_prefix_caching and c.ssm_checkpoint_interval else 0
    conv_dtype, state_dtype = state_dtypes(c, runner.dtype, runner.hf_config)
    cache = allocate(runner.model.state_cache_spec(conv_dtype, state_dtype), num_slots, runner.device, snapshots)
    weakref.finalize(runner, release, cache)
    for layer, (conv, ssm) in zip(layers, cache.tensors):
        layer.bind_state_cache(conv, ssm)
    log.info("%s", cache.describe())
    return cache
