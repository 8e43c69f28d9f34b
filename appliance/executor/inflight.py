"""Steps in flight (overlap mode): the sampled ids of a launched step stay on the device until finish().

A step whose sampled rows all take a device path (greedy argmax or the Triton sampler; no logprobs, penalties,
seeds or constrained decoding) is launched without reading anything back: its ids are copied into pinned host
memory behind the step's kernels and an event marks their arrival. The next step's decode rows take their input
ids from that device tensor (`resolve_pending_ids`), so the runner can launch step N+1 while step N still runs,
and the only wait per step is for step N's ids when its result is collected. A speculative step decided and drafted
on the device (device_proposal.py) is in flight too: its handle's `completion` reads its verdict and drafts, and
the runner completes it before it launches the next step (which starts from where it ended), so the engine plans
that step while this one runs; a next verification of the same requests is launched before that read
(verify_ahead.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from appliance.engine.step import SampledToken, StepResult
from appliance.executor.input_batch import Chunk, Stager


@dataclass
class StepHandle:
    """A launched step: either finished (result) or deferred (ids on their way to `host`)."""

    step_id: int
    result: StepResult | None = None
    chunks: tuple[Chunk, ...] = ()  # the sampling chunks, in the order of `device_ids`' rows
    device_ids: torch.Tensor | None = None
    host_ids: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    plan_order: dict[str, int] | None = None  # request id -> position in the plan, when rows were reordered
    completion: Callable[[], StepResult] | None = None  # a speculative step in flight: reads and returns its result

    @property
    def done(self) -> bool:
        return self.result is not None


def defer(step_id: int, chunks: list[Chunk], device_ids: torch.Tensor,
          plan_order: dict[str, int] | None) -> StepHandle:
    """Start the copy of a step's sampled ids to the host and mark each request's token as pending."""
    if device_ids.device.type == "cuda":
        host = torch.empty(device_ids.shape, dtype=device_ids.dtype, pin_memory=True)
        host.copy_(device_ids, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
    else:
        host, event = device_ids, None
    for row, c in enumerate(chunks):
        c.state.num_pending += 1
        c.state.pending_at = (device_ids, row)
    return StepHandle(step_id, None, tuple(chunks), device_ids, host, event, plan_order)


def complete(handle: StepHandle) -> StepResult:
    """Wait for a deferred step's ids and append them to their requests (steps complete in launch order)."""
    if handle.result is not None:
        return handle.result
    if handle.completion is not None:
        handle.result, handle.completion, handle.event = handle.completion(), None, None
        return handle.result
    if handle.event is not None:
        handle.event.synchronize()
    assert handle.host_ids is not None
    sampled: list[SampledToken] = []
    for c, token in zip(handle.chunks, handle.host_ids.tolist()):
        state = c.state
        state.token_ids.append(int(token))
        state.num_pending -= 1
        if state.pending_at is not None and state.pending_at[0] is handle.device_ids:
            state.pending_at = None
        sampled.append(SampledToken(state.request_id, int(token)))
    if handle.plan_order is not None:
        sampled.sort(key=lambda t: handle.plan_order[t.request_id])  # type: ignore[index]
    handle.result = StepResult(handle.step_id, sampled)
    handle.chunks, handle.device_ids, handle.host_ids, handle.event = (), None, None, None
    return handle.result


def resolve_pending_ids(ordered: list[Chunk], ids: torch.Tensor, stager: Stager) -> None:
    """Write the input ids of decode rows whose token is still in flight, from the device, in place.

    ordered: the step's chunks in row order (one-token rows first); ids: the step's input-id rows (pending rows
    hold a placeholder). One upload of [rows | source rows] per source tensor; normally there is one source,
    the previous step's sampled ids."""
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for row, c in enumerate(ordered):
        if c.num_tokens != 1:
            break
        if c.start < len(c.state.token_ids):
            continue
        if c.state.pending_at is None or c.start != c.state.num_tokens - 1:
            raise RuntimeError(f"request {c.state.request_id!r}: input token {c.start} is neither known nor the "
                               "latest sample in flight")
        src, at = c.state.pending_at
        groups.setdefault(id(src), (src, [], []))
        groups[id(src)][1].append(row)
        groups[id(src)][2].append(at)
    if not groups:
        return
    # one staged upload for all groups: a second send on the stager would wait for the first copy
    flat = np.concatenate([np.asarray(rows + at, dtype=np.int64) for _, rows, at in groups.values()])
    index = stager.send(flat)
    start = 0
    for src, rows, _ in groups.values():
        k = len(rows)
        ids.index_copy_(0, index[start : start + k], src.index_select(0, index[start + k : start + 2 * k]))
        start += 2 * k
