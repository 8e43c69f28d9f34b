"""EngineCore: the synchronous engine loop over a Scheduler and an Executor (pure Python, no torch).

    core = EngineCore(EngineConfig(num_blocks=...), executor)
    core.add_request("r1", [1, 2, 3], SamplingParams(max_tokens=8))
    while core.has_work():
        for delta in core.step(): ...

One step = schedule -> executor.execute(plan) -> update. With overlap=True (scheduler.enable_overlap) one step
stays in flight: step() plans step N+1 assuming every running request continues (its sample from step N counts
as a pending token), submits it, and only then collects step N's result and applies it. Stops therefore take
effect one step late on the device, never in the output: a request that step N finishes (EOS, stop token) or
that is aborted meanwhile has its step N+1 result dropped, and one that its pending tokens finish by length is
not scheduled again, so max_tokens is exact and the outputs equal the synchronous loop's.

Parallel sampling (n > 1) is fanned out above the engine: the API layer submits n requests with distinct ids
(and seeds) and gathers their outputs; prefix caching makes their shared prompt cost one prefill.
Stop strings are matched on text by the detokenizer, which then calls abort().
"""
from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from appliance.engine.block_pool import AccountingReport
from appliance.engine.config import EngineConfig
from appliance.engine.delta import RequestDelta
from appliance.engine.prefix_cache import KVEventSink
from appliance.engine.request import Request, exact_ints
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.scheduler import QueueFull, Scheduler
from appliance.engine.step import Executor, StepPlan

__all__ = ["EngineCore", "EngineStats", "QueueFull"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # fraction of blocks held by live requests (evictable cache blocks count as free)
    blocks_total: int
    blocks_free: int
    blocks_cached: int  # unreferenced blocks kept for prefix hits
    blocks_owned: int
    prefix_hit_rate: float  # hit tokens / looked-up prompt tokens, over the engine's life
    prefix_queried_tokens: int
    prefix_hit_tokens: int
    num_preemptions: int
    num_steps: int
    # speculative decoding, cumulative (0 without it): verifications, draft tokens verified, drafts accepted
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()  # [j]: verifications that accepted draft j
    # the host and disk tiers' block copies, cumulative (host_tier.py counts(); empty without a host tier)
    tier_counts: dict[str, int] = field(default_factory=dict)

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / verified draft tokens (0 before the first verification)."""
        return self.spec_num_accepted_tokens / self.spec_num_draft_tokens if self.spec_num_draft_tokens else 0.0

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens emitted per verification: 1 + accepted drafts / verifications (vLLM's mean acceptance length)."""
        return 1.0 + self.spec_num_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0

    @property
    def spec_num_emitted_tokens(self) -> int:
        """Tokens verifications emitted: the accepted drafts plus one token of the target's each."""
        return self.spec_num_accepted_tokens + self.spec_num_drafts


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        on_kv_event: KVEventSink | None = None,
        clock: Callable[[], float] = time.monotonic,
        overlap: bool = False,
    ) -> None:
        if overlap and config.num_speculative_tokens and config.num_state_slots:
            # their state snapshots and rollback follow the plan's chunk, which a verification in flight changes
            raise ValueError("overlap scheduling with speculative decoding is not supported for models with "
                             "recurrent-state layers; turn scheduler.enable_overlap off")
        self.config = config
        self.executor = executor
        self.scheduler = Scheduler(config, on_kv_event, clock)
        self._clock = clock
        self._num_steps = 0
        self.overlap = overlap
        self._pending: tuple[StepPlan, object] | None = None  # the step in flight (overlap mode)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Queue a request. Raises ValueError for a bad request (empty, too long, duplicate id) and
        QueueFull when scheduler.max_queued_requests requests are already waiting."""
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if sp.n != 1:
            raise ValueError("EngineCore runs one sequence per request; fan out n > 1 above the engine")
        if type(prompt_token_ids) is list and exact_ints(prompt_token_ids):
            prompt = list(prompt_token_ids)  # what the server sends: one C-level type scan instead of a call per id
        else:
            try:  # accepts numpy ints, refuses floats and strings instead of truncating them
                prompt = [operator.index(t) for t in prompt_token_ids]
            except TypeError as e:
                raise ValueError(f"request {request_id!r}: prompt token ids must be integers ({e})") from None
        req = Request(
            request_id=request_id,
            prompt_token_ids=prompt,
            sampling_params=sp,
            arrival_time=self._clock() if arrival_time is None else arrival_time,
            eos_token_ids=self.config.eos_token_ids,
            max_model_len=self.config.max_model_len,
        )
        self.scheduler.add(req)

    def can_queue(self) -> bool:
        """Whether add_request would pass the max_queued_requests check now."""
        return self.scheduler.can_queue()

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its blocks at once; False if it is unknown or already finished."""
        return self.scheduler.abort(request_id) is not None

    def step(self) -> list[RequestDelta]:
        """Run one step; returns a delta for every request that got a token (and possibly finished)."""
        if self.overlap:
            return self._step_overlapped()
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        result = self.executor.execute(plan)
        self._num_steps += 1
        return self.scheduler.update(plan, result)

    def _step_overlapped(self) -> list[RequestDelta]:
        """Submit step N+1, then collect and apply step N: the host plans while the device computes."""
        plan = self.scheduler.schedule()
        previous, self._pending = self._pending, None
        if plan is not None:
            self._pending = (plan, self.executor.submit(plan))
            self._num_steps += 1  # counted when submitted, like the synchronous loop counts the steps it runs
        if previous is None:
            return []
        result = self.executor.collect(previous[1])
        return self.scheduler.update(previous[0], result)

    def has_work(self) -> bool:
        return bool(self.scheduler.requests) or self._pending is not None

    def get_request(self, request_id: str) -> Request | None:
        return self.scheduler.requests.get(request_id)

    def reset_prefix_cache(self) -> int:
        n = self.scheduler.cache.reset()
        if self.scheduler.windows is not None:  # the sliding groups' caches too (after: a shared pool's reset)
            self.scheduler.windows.reset_caches()
        return n

    def stats(self) -> EngineStats:
        s = self.scheduler
        # every pool's blocks: the full group's and the sliding groups' (their null blocks are no KV)
        pools = [s.pool] + (s.windows.pools if s.windows is not None and s.windows.shared is None else [])
        total, owned = sum(p.num_usable for p in pools), sum(p.num_owned for p in pools)
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_usage=owned / total,
            blocks_total=total,
            blocks_free=sum(p.num_free for p in pools),
            blocks_cached=sum(p.num_evictable for p in pools),
            blocks_owned=owned,
            prefix_hit_rate=s.cache.hit_rate,
            prefix_queried_tokens=s.cache.queried_tokens,
            prefix_hit_tokens=s.cache.hit_tokens,
            num_preemptions=s.num_preemptions,
            num_steps=self._num_steps,
            spec_num_drafts=s.spec.num_drafts,
            spec_num_draft_tokens=s.spec.num_draft_tokens,
            spec_num_accepted_tokens=s.spec.num_accepted_tokens,
            spec_accepted_per_pos=tuple(s.spec.accepted_per_pos),
            tier_counts=s.cache.host.counts() if s.cache.host is not None else {},
        )

    def spec_counts(self) -> tuple[int, int, int]:
        """(verifications, draft tokens, accepted tokens), cumulative: observability's snapshot `spec` argument."""
        return self.scheduler.spec.as_tuple()

    def check_accounting(self) -> AccountingReport:
        """free + cached + owned == total, and every refcount equals the number of live tables holding it."""
        refs = self.scheduler.live_block_refs()
        windows = self.scheduler.windows
        if windows is not None and windows.shared is not None:  # one pool: every group's tables hold its blocks
            for g in range(len(windows.groups)):
                for b, n in windows.refs(g).items():
                    refs[b] = refs.get(b, 0) + n
        rep = self.scheduler.pool.check_accounting(refs)
        host = self.scheduler.cache.host
        owned = [s for r in self.scheduler.requests.values() for s in r.swap_slots]
        if host is not None and (problems := host.check(owned)):
            rep = replace(rep, problems=rep.problems + tuple(problems))
        for w, win in zip(self.config.window_sizes, windows.check_accounting() if windows is not None else []):
            problems = rep.problems + tuple(f"window {w}: {p}" for p in win.problems)
            rep = AccountingReport(rep.total + win.total, rep.free + win.free, rep.cached + win.cached,
                                   rep.owned + win.owned, problems)
        return rep

    def shutdown(self) -> None:
        pending, self._pending = self._pending, None
        try:
            if pending is not None:  # let the device finish the step in flight before tearing down
                self.executor.collect(pending[1])
        except Exception as exc:  # a failed executor already failed the step() that saw it: tear down anyway
            log.warning("the step in flight failed during shutdown: %s", exc)
        finally:
            self.executor.shutdown()
