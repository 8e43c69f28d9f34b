"""What the scheduler tells the workers each step, and what they answer.

Plain ints, floats, strings and lists only, so the runtime's msgpack codec is trivial and nothing is pickled.
Workers keep per-request state between steps (all token ids, block table, sampling params, RNG), so a step
carries only what changed: requests that are new to the workers, how many tokens each scheduled request
computes now, blocks appended to its table, and requests to forget.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class NewRequestData:
    """A request the workers have not seen (or must rebuild after preemption)."""

    request_id: str
    token_ids: list[int]  # prompt followed by the tokens generated so far (non-empty after preemption)
    num_prompt_tokens: int  # token_ids[:num_prompt_tokens] is the prompt; the rest counts as output
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hit)
    block_ids: list[int]
    sampling: dict[str, Any]  # SamplingParams.to_dict()
    restore_snapshot: int = -1  # hybrid models: copy this state snapshot into the request first (state_snapshots.py)
    # the request's table in each sliding-window group (kv_groups.py), as long as block_ids; NULL_BLOCK entries
    # before the window; empty without sliding groups
    window_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: compute `num_tokens` tokens starting at the worker's num_computed."""

    request_id: str
    num_tokens: int
    # appended to the request's block table before the step runs; with sliding-window groups (kv_groups.py) as many
    # again for each group's table follow, in group order (one flat list: no field more on every row of every
    # plan). Blocks the engine releases later stay in the workers' tables: no query reads them again
    new_block_ids: list[int]
    sample: bool  # sample a token after this chunk (last prefill chunk, or a decode)
    save_snapshot: int = -1  # hybrid models: copy the request's state into this snapshot slot after the chunk


@dataclass(frozen=True)
class StepPlan:
    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)  # forget these before running the step
    # host-tier copies (engine/host_tier.py), run in order before each layer's use of its cache: (0, block, slot)
    # device -> host, (1, block, slot) host -> device; the disk tier's (engine/disk_tier.py): (2, disk slot, host
    # slot) host -> disk, (3, disk slot, host slot) disk -> host
    host_copies: list[tuple[int, int, int]] = field(default_factory=list)
    # the last host_writes of host_copies are write-through stores (engine/prefix_cache.py write_through): of
    # blocks no forward rewrites before they are evicted, so this step's forward need not wait for them (the next
    # step's does, before anything could reuse the blocks)
    host_writes: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass(frozen=True)
class SampledToken:
    request_id: str
    token_id: int
    logprob: float | None = None  # of the sampled token, when the request asked for logprobs
    top_logprobs: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    rank: int | None = None  # 1-based rank of the sampled token in the raw distribution, when logprobs are asked
    error: str | None = None  # sampling this request failed: it ends alone with this error (token_id is a filler)


@dataclass(frozen=True)
class StepResult:
    step_id: int
    sampled: list[SampledToken] = field(default_factory=list)
    # prompt logprobs per request when asked: one entry per prompt position (None for the first)
    prompt_logprobs: dict[str, list[list[tuple[int, float]] | None]] = field(default_factory=dict)
    # speculative decoding: drafts the workers hold after this step, per request that sampled and has some
    # (the next step verifies at most that many; absent = none, e.g. no n-gram match)
    drafts: dict[str, int] = field(default_factory=dict)
    # overlap mode: drafts a verification checked, where the workers held fewer than its plan asked for
    verified: dict[str, int] = field(default_factory=dict)


class Executor:
    """Runs step plans. InProcessExecutor (executor/) and the runtime's remote executor implement it.

    The overlap mode uses the asynchronous pair: submit(plan) starts a step and returns a handle, collect(handle)
    waits for its result. Steps run in submission order, so a worker applies plan N+1 after step N (appending
    step N's sampled tokens itself). The defaults run the step inside submit; an executor whose device or
    workers run asynchronously overrides both, and execute stays collect(submit(plan)).
    """

    def execute(self, plan: StepPlan) -> StepResult:  # pragma: no cover - interface
        raise NotImplementedError

    def submit(self, plan: StepPlan) -> object:
        return self.execute(plan)

    def collect(self, handle: object) -> StepResult:
        if not isinstance(handle, StepResult):
            raise TypeError(f"collect() got {type(handle).__name__}, not a handle of this executor's submit()")
        return handle

    def shutdown(self) -> None:  # pragma: no cover - interface
        pass
