"""Continuous batching: turns the request queues into one StepPlan per step (pure Python, no torch).

The order of a step, the plan's delta convention, overlap, speculative decoding and sliding-window groups as the
scheduler sees them: docs/architecture.md, "Scheduler". The step's budget and chunk sizes: step_budget.py; a step's
sampled tokens into request state: outputs.py; admission room for outputs: admission.py; preemption: preemption.py.
"""
from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from itertools import islice

from appliance.engine.admission import OutputReservation
from appliance.engine.block_pool import BlockPool
from appliance.engine.config import EngineConfig
from appliance.engine.delta import RequestDelta
from appliance.engine.host_tier import WRITE_THROUGH_BLOCKS
from appliance.engine.kv_groups import KVGroup
from appliance.engine.outputs import (
    append_token,
    append_verified,
    group_sampled,
    take_prompt_logprobs,
)
from appliance.engine.preemption import Preemption
from appliance.engine.prefix_cache import KVEventSink, PrefixCache
from appliance.engine.request import (
    DECODING,
    PREEMPTED,
    PREFILLING,
    FinishReason,
    Request,
    RequestStatus,
)
from appliance.engine.slo import SloPolicy
from appliance.engine.speculation import SpecCounters, table_tokens
from appliance.engine.state_snapshots import StateSnapshots
from appliance.engine.step import StepPlan, StepResult
from appliance.engine.step_budget import Issued, StepBudget
from appliance.engine.swap import SwapPolicy
from appliance.engine.window_blocks import WindowBlocks


class QueueFull(RuntimeError):
    """scheduler.max_queued_requests waiting requests already: the caller should answer 503."""


class Scheduler(Preemption):
    def __init__(self, config: EngineConfig, on_kv_event: KVEventSink | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.slo = SloPolicy(config.slo_tbt_ms / 1000.0) if config.policy == "slo" else None
        self._planned_at: dict[int, tuple[float, int]] = {}  # step id -> (clock, prefill tokens): policy slo
        self._last_update_at = 0.0
        # with shared window groups the sliding tables draw from this pool too, whose block 0 is then their null block
        self.pool = BlockPool(config.num_blocks, null_block=config.window_shared)
        self.cache = PrefixCache(self.pool, config.block_size, config.enable_prefix_caching, on_kv_event,
                                 config.num_host_blocks, config.num_disk_blocks,
                                 config.host_cache_write_policy == "write_through")
        # hybrid models with prefix caching: recurrent-state snapshots at checkpoints (state_snapshots.py)
        self.snapshots = (StateSnapshots(config.ssm_snapshot_slots, config.ssm_checkpoint_interval,
                                         config.block_size)
                          if config.num_state_slots and config.enable_prefix_caching else None)
        self.swap = SwapPolicy(config.preemption_mode, config.swap_costs)  # what preemption keeps (swap.py)
        # sliding-window groups: their tables beside the full group's, from pools of their own or this one
        self.windows = (WindowBlocks([KVGroup(w, ()) for w in config.window_sizes], config.window_blocks,
                                     config.block_size, config.enable_prefix_caching,
                                     (self.pool, self.cache) if config.window_shared else None)
                        if config.window_sizes else None)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self.requests: dict[str, Request] = {}  # live requests (waiting or running)
        self.num_preemptions = 0
        self._forget: list[str] = []  # ids the workers must drop with the next plan
        self._next_step_id = 0
        self._issue_seq = 0
        self._in_flight: dict[int, list[Issued]] = {}
        self.spec = SpecCounters()
        # read for every request each step: plain attributes instead of the frozen config's properties
        self._chunking = config.chunking
        self._block_size = config.block_size
        self._num_spec = config.num_speculative_tokens
        self._lookahead = config.lookahead
        self._mixed_prefill = config.max_mixed_prefill_tokens
        # room reserved at admission for the running requests' outputs (admission.py); None: none, no bookkeeping
        c = config.schedule_conservativeness
        self._reserve = (OutputReservation(c, config.block_size, self.running, self._shared_blocks,
                                            config.step_token_budget, config.max_mixed_prefill_tokens)
                         if c > 0 else None)

    # ---- admission ---------------------------------------------------------------------------------------
    def can_queue(self) -> bool:
        """True while max_queued_requests (if set) leaves room for one more waiting request."""
        limit = self.config.max_queued_requests
        return limit is None or len(self.waiting) < limit

    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        if req.status is not RequestStatus.WAITING:
            raise ValueError(f"request {req.request_id!r} is {req.status.value}, not waiting")
        if req.sampling_params.priority and self.slo is None:
            raise ValueError(f"request {req.request_id!r}: priority needs scheduler.policy = \"slo\" "
                             f"(this engine runs {self.config.policy})")
        if not self.can_queue():
            raise QueueFull(f"{len(self.waiting)} requests are waiting (scheduler.max_queued_requests)")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Drop a live request now, blocks included (even mid-prefill); None if it is not live."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status.is_running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self._retire(req, FinishReason.ABORT)
        return req

    # ---- planning ----------------------------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        """Plan the next step, or return None when there is nothing to compute (forget-lists wait)."""
        st = StepBudget(self.config.step_token_budget, self._chunking, self._num_spec, self._issue_seq)
        self._schedule_running(st)
        if not st.preempted:
            self._schedule_waiting(st)
        self._issue_seq = st.issue_seq
        if self._reserve is not None:
            self._reserve.step_done(self.running, st.preempted)
        if not st.plan_sched:
            return None
        copies, writes = self._host_copies()
        plan = StepPlan(self._next_step_id, st.plan_new, st.plan_sched, self._forget, copies, writes)
        self._next_step_id += 1
        self._forget = []
        self._in_flight[plan.step_id] = st.issued
        if self.slo is not None:
            prefill = sum(sc.num_tokens for sc, req, _, _ in st.issued if req.status is not DECODING)
            self._planned_at[plan.step_id] = (self._clock(), prefill)
        return plan

    def _host_copies(self) -> tuple[list[tuple[int, int, int]], int]:
        """The host tier's copies for the plan: what admissions, evictions and swaps queued, then under
        write-through some blocks cached since, in a step that loads nothing (a load's step is an admission's: its
        first token waits for the copies); and how many of the last ones are the write-through's."""
        host = self.cache.host
        if host is None:
            return [], 0
        queued = len(host.copies)
        if not host.loading():
            self.cache.write_through(WRITE_THROUGH_BLOCKS)
        writes = len(host.copies) - queued  # its stores, and the disk spills of the slots they took
        return host.take_copies(), writes

    def _cap_prefills(self, st: StepBudget) -> None:
        """Policy slo: the prefill chunks still to plan get only what keeps this step within the decodes' slack."""
        assert self.slo is not None
        decoding = [req for _, req, _, _ in st.issued if req.status is DECODING]
        cap = self.slo.prefill_cap(decoding, self._clock())
        if cap is None:
            return
        prefill = sum(sc.num_tokens for sc, req, _, _ in st.issued if req.status is not DECODING)
        st.tokens = min(st.tokens, max(cap - prefill, 0))

    def _schedule_running(self, st: StepBudget) -> None:
        # Whether a request decodes is decided here, once: planning one request changes no other's answer
        # (a preemption takes its victim out of the loop).
        decoding: list[Request] = []
        prefilling: list[Request] = []
        for req in self.running:
            (decoding if req.status is DECODING or _decodes(req) else prefilling).append(req)
        if self._chunking and len(decoding) > st.tokens:
            # Not all decodes fit the budget: least recently scheduled first (round-robin), so none starves;
            # policy slo: the nearest deadline first.
            decoding.sort(key=self.slo.decode_key if self.slo is not None else lambda r: r.last_issue_seq)
        if self.slo is not None:
            prefilling.sort(key=self.slo.prefill_key)
        off_above = self.config.spec_disable_batch_size
        speculate = self._num_spec and (off_above is None or len(decoding) <= off_above)
        for req in decoding:
            if req.status is PREEMPTED:  # a victim of an earlier request in this loop
                continue
            if speculate:
                self._schedule_chunk(req, st, True)
            else:
                self._schedule_decode(req, st)
        st.cap_mixed_prefill(self._mixed_prefill)
        if self.slo is not None:
            self._cap_prefills(st)
        for req in prefilling:
            if req.status is not PREEMPTED:
                self._schedule_chunk(req, st, False)

    def _schedule_decode(self, req: Request, st: StepBudget) -> None:
        """_schedule_chunk for a decoding request without speculative decoding: the common case of every step,
        with StepBudget.chunk and table_tokens folded in for k = 0 (no drafts, no lookahead blocks); same outcome."""
        pending = req.num_pending
        if pending and req.will_reach_length:
            return  # its in-flight sample is its last token
        n = req.num_prompt_tokens + len(req.output_token_ids) + pending - req.num_computed_tokens
        if n == 0 or (self._chunking and n > st.tokens):
            return
        need = -(-(req.num_computed_tokens + n) // self._block_size) - len(req.block_ids)
        new_blocks = self._take_blocks(req, need, st) if need > 0 else []
        if new_blocks is not None:
            st.issue(req, n, new_blocks, True, -1, self._window_tails(req, len(new_blocks)) if new_blocks else None)

    def _schedule_chunk(self, req: Request, st: StepBudget, decodes: bool) -> None:
        """Schedule a running request's next chunk (a decode, drafts included, or a prefill chunk) if the budget
        and the blocks allow, preempting newer requests for blocks."""
        n = st.chunk(req, decodes)
        if n == 0:
            return
        if self.snapshots is not None and not decodes:
            n = self.snapshots.cut(req.num_computed_tokens, n)
        need = self._blocks_for(table_tokens(req, req.num_computed_tokens, n, self._lookahead)) - len(req.block_ids)
        # need < 0: rejected drafts left lookahead blocks, which the table keeps
        new_blocks = self._take_blocks(req, need, st) if need > 0 else []
        if new_blocks is not None:
            st.issue(req, n, new_blocks, decodes, self._snapshot_slot(req, req.num_computed_tokens + n),
                     self._window_tails(req, len(new_blocks)) if new_blocks else None)

    def _schedule_waiting(self, st: StepBudget) -> None:
        cfg = self.config
        for req in self._waiting_order():
            if len(self.running) >= cfg.max_num_seqs or (self._chunking and st.tokens <= 0):
                return
            if not self._admit(req, st):
                return  # head-of-line: later requests wait too, so big prompts are not starved

    def _waiting_order(self) -> list[Request]:
        if self.config.policy == "fcfs":
            # Admission stops at the first request that does not fit, so only the free seats matter.
            return list(islice(self.waiting, max(0, self.config.max_num_seqs - len(self.running))))
        preempted = [r for r in self.waiting if r.status is RequestStatus.PREEMPTED]
        fresh = [r for r in self.waiting if r.status is RequestStatus.WAITING]
        if self.slo is not None:
            return preempted + sorted(fresh, key=self.slo.waiting_key)
        k = self.config.lpm_scan_limit
        head = sorted(fresh[:k], key=lambda r: -len(self.cache.match(r)))  # stable: ties stay fcfs
        return preempted + head + fresh[k:]

    def _admit(self, req: Request, st: StepBudget) -> bool:
        # a swapped request's own blocks come back from the host tier (preemption.py), else a prefix lookup
        hit, host_hit, restore, num_hit = (self._swapped_hit(req) if req.swap_slots else
                                           self.cache.lookup(req, self.config.spec_drafter_reads_next, self.snapshots))
        win = self.windows
        if win is not None and hit:  # the sliding groups must hold the window the queries after the hit read
            hit = hit[:win.hit(req, len(hit))]
            num_hit = len(hit) * self.config.block_size  # no host tier with sliding groups (config.py)
        n = st.prefill_size(req.num_tokens - num_hit)
        if n == 0:
            return False
        if self.snapshots is not None:
            n = self.snapshots.cut(num_hit, n)
        end = table_tokens(req, num_hit, n, self._lookahead)
        need = self._blocks_for(end) - len(hit)  # host hits included
        revived = sum(1 for b in hit if self.pool.is_evictable(b))
        spare = self.pool.num_available - need - revived  # blocks left after this chunk's
        rsv = self._reserve  # it also wants room for the rest of the prompt and the outputs (admission.py)
        if rsv is not None and win is not None and win.shared is not None and self.running:  # and the sliding
            spare -= win.room(self.running, req, len(hit), end)  # tables' (one alone is always admitted)
        if spare < 0 or (rsv is not None and not rsv.fits(req, spare, req.num_tokens - num_hit - n, hit)):
            return False
        if win is not None and not win.fits(req, len(hit), end, need + revived):
            return False
        for b in hit:  # take the hits before allocating, so allocation cannot evict them
            self.pool.incref(b)
        if host_hit:  # nor reuse the host slots about to be loaded (disk hits are fetched into host slots now)
            host_hit = self.cache.host.pin(host_hit)
        # the sliding groups take their window's hits before this pool allocates (it may be theirs too)
        window_tables = win.admit(req, len(hit), end) if win is not None else None
        new_blocks = self.pool.allocate(need)
        if host_hit:
            self.cache.load_host(host_hit, new_blocks[:len(host_hit)])
        if req.swap_slots:
            self._swap_in(req, len(hit), num_hit, new_blocks)
        req.block_ids = hit + new_blocks
        req.num_computed_tokens = num_hit
        req.num_stored_blocks = len(hit) + len(host_hit)
        if req.status is RequestStatus.WAITING:
            req.num_cached_tokens = num_hit
            self.cache.record_lookup(req.num_tokens, num_hit)
        self.waiting.remove(req)
        req.transition(RequestStatus.PREFILLING)
        self.running.append(req)
        if self._reserve is not None:
            self._reserve.admitted(req)
        st.issue_new(req, n, restore, self._snapshot_slot(req, num_hit + n), window_tables)
        return True

    def _snapshot_slot(self, req: Request, end: int) -> int:
        """The snapshot slot a chunk ending at `end` saves its state into (-1: none): at a checkpoint of the
        prefill, once per prefix."""
        snaps = self.snapshots
        if snaps is None or end % snaps.interval or end > req.num_prompt_tokens + len(req.output_token_ids):
            return -1
        return snaps.claim(self.cache.block_hashes(req)[end // self.config.block_size - 1])

    def _shared_blocks(self, req: Request) -> int:
        """How many of req's first blocks other requests hold too. Prefix hits share a table's first blocks, so
        refcounts never rise along a table and the shared blocks are a prefix: found by bisection."""
        ref = self.pool.refcount
        return bisect_left(req.block_ids, True, key=lambda b: ref(b) <= 1)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    # ---- results -----------------------------------------------------------------------------------------
    def update(self, plan: StepPlan, result: StepResult) -> list[RequestDelta]:
        """Apply a step's sampled tokens: append, check stops, cache full blocks, retire finished requests."""
        if result.step_id != plan.step_id:
            raise ValueError(f"result of step {result.step_id} given for plan {plan.step_id}")
        scheduled = self._in_flight.pop(plan.step_id, None)
        if scheduled is None:
            raise ValueError(f"step {plan.step_id} is not in flight")
        sampled, verified = group_sampled(result.sampled)
        expected = {s.request_id for s, _, _, _ in scheduled if s.sample}
        if not expected.issuperset(sampled):
            raise ValueError(f"executor sampled for unexpected requests {sorted(set(sampled) - expected)}")
        live = self.requests
        cache = self.cache
        reserve = self._reserve
        prompt_logprobs = result.prompt_logprobs
        now = self._observe_step(plan.step_id) if self.slo is not None else 0.0
        deltas: list[RequestDelta] = []
        for s, req, num_preemptions, drafts in scheduled:
            status = req.status
            if (req.num_preemptions != num_preemptions or live.get(s.request_id) is not req
                    or (status is not DECODING and status is not PREFILLING)):
                continue  # finished, aborted or preempted after the step was planned: its result is dropped
            if self.windows is not None:  # store the sliding groups' full blocks, release what left the window
                self.windows.after_step(req, req.num_computed_tokens)
            if prompt_logprobs:
                take_prompt_logprobs(req, result)
            if not s.sample:
                cache.store(req)
                continue
            req.num_pending -= 1 + drafts
            req.num_drafts_held = result.drafts.get(s.request_id, 0)
            tok = sampled.get(s.request_id)
            if tok is None:
                raise ValueError(f"executor did not sample a token for {s.request_id!r}")
            if tok.error is not None:  # its sampling failed in the worker: it ends alone, the batch goes on
                self.running.remove(req)
                self._retire(req, FinishReason.ABORT)
                deltas.append(RequestDelta(s.request_id, (), "error", req.num_prompt_tokens, req.num_cached_tokens,
                                           error=tok.error))
                continue
            if drafts or (verified and s.request_id in verified):
                delta = append_verified(req, verified.get(s.request_id, [tok]), drafts, cache, reserve, self.spec,
                                        result.verified.get(s.request_id))
            else:
                delta = append_token(req, tok, cache, reserve)
            req.last_token_time = now
            if delta.finish_reason is not None:
                self.running.remove(req)
                self._retire(req, FinishReason(delta.finish_reason))
            deltas.append(delta)
        return deltas

    def _observe_step(self, step_id: int) -> float:
        """Policy slo: feed the step's duration to the cost model; returns now (the step's tokens' time)."""
        assert self.slo is not None
        now = self._clock()
        planned, prefill = self._planned_at.pop(step_id)
        self.slo.cost.observe(now - max(planned, self._last_update_at), prefill)
        self._last_update_at = now
        return now

    @property
    def num_in_flight(self) -> int:
        """Steps planned whose results have not been applied yet."""
        return len(self._in_flight)

    # ---- introspection -----------------------------------------------------------------------------------
    @property
    def pending_forget(self) -> tuple[str, ...]:
        return tuple(self._forget)

    def live_block_refs(self) -> dict[int, int]:
        """Block id -> number of live request tables holding it (what the refcounts must equal)."""
        refs: dict[int, int] = {}
        for req in self.requests.values():
            for b in req.block_ids:
                refs[b] = refs.get(b, 0) + 1
        return refs


def _decodes(req: Request) -> bool:
    """It decodes next: DECODING, or a prefill whose last chunk's sample is still in flight (overlap mode)."""
    return req.status is DECODING or (
        req.status is PREFILLING and req.num_pending > 0 and req.num_uncomputed_tokens <= req.num_pending
    )
