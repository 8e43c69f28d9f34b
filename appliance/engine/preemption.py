"""Preemption (recompute or swap) and retirement of the scheduler's requests: a Scheduler base class.

When a running request needs a block and none is free or evictable, the newest running request not yet
scheduled in this step is preempted (blocks freed, state reset, re-queued at the front); in the worst case that
is the request itself. Recompute prefills it again on resume; a swapped one (engine/swap.py decides) first has its
computed blocks copied to host slots it owns, and on resume the blocks a device prefix hit does not cover are
copied back and its computed tokens restored (all but the last token, which it recomputes to sample).
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from appliance.engine.block_pool import BlockPool
from appliance.engine.disk_tier import DiskBlock
from appliance.engine.host_tier import HostBlock
from appliance.engine.prefix_cache import PrefixCache
from appliance.engine.request import PREEMPTED, FinishReason, Request, RequestStatus
from appliance.engine.step_budget import StepBudget
from appliance.engine.swap import SwapPolicy

if TYPE_CHECKING:
    from appliance.engine.admission import OutputReservation
    from appliance.engine.slo import SloPolicy
    from appliance.engine.window_blocks import WindowBlocks


class Preemption:
    """The block taking, preemption and retirement of Scheduler (engine/scheduler.py), which sets these."""

    pool: BlockPool
    cache: PrefixCache
    swap: SwapPolicy
    _block_size: int
    windows: WindowBlocks | None
    running: list[Request]
    waiting: deque[Request]
    requests: dict[str, Request]
    slo: SloPolicy | None
    num_preemptions: int
    _forget: list[str]
    _reserve: OutputReservation | None

    def _take_blocks(self, req: Request, need: int, st: StepBudget) -> list[int] | None:
        """Append `need` (> 0) new blocks to the request's table (and to its sliding groups' tables), preempting
        newer requests while a pool is short; None when the request itself was preempted."""
        win = self.windows
        if win is not None:  # first what left the window (overlap mode: the step in flight moved it since the update)
            win.after_step(req, req.num_computed_tokens)
        while ((need > self.pool.num_available or (win is not None and not win.can_take(need)))
               and req.status is not PREEMPTED):
            self._preempt(self._victim(st))
            st.preempted = True
        if req.status is PREEMPTED:
            return None
        new_blocks = self.pool.allocate(need)
        req.block_ids.extend(new_blocks)
        if win is not None:
            win.take(req, need)
        return new_blocks

    def _window_tails(self, req: Request, n: int) -> list[list[int]] | None:
        """The last n entries of each of the request's sliding-group tables (taken with its full table's)."""
        if self.windows is None or n == 0:
            return None
        return [t.block_ids[len(t.block_ids) - n:] for t in self.windows.tables[req.request_id]]

    def _victim(self, st: StepBudget) -> Request:
        unscheduled = [r for r in reversed(self.running) if r.last_issue_seq < st.first_issue_seq]
        if not unscheduled:
            raise AssertionError("no preemptable request although the current one is unscheduled")
        if self.slo is not None:  # the lowest priority (largest value), newest among equals
            return max(unscheduled, key=lambda r: r.sampling_params.priority)
        return unscheduled[0]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._swap_out(req)
        self._release_blocks(req)
        req.transition(RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        req.num_pending = 0  # an in-flight sample is dropped; recompute samples it again
        req.num_drafts_held = 0  # workers drop its drafts with its state
        req.last_token_time = None  # no deadline until it decodes again
        req.num_preemptions += 1
        if not req.prompt_logprobs_done:
            req.prompt_logprobs = []
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _swap_out(self, req: Request) -> None:
        """Keep the request's computed blocks in host slots it owns, if the policy swaps it and slots are had."""
        host, n = self.cache.host, req.num_computed_tokens
        if host is None or req.sampling_params.prompt_logprobs is not None:  # prompt logprobs need the prefill
            return
        nb = -(-n // self._block_size)
        if not self.swap.swaps(n, nb):
            return
        slots = host.take_owned(nb)
        if slots is None:  # the host tier is held by other swapped requests: recompute
            return
        host.swap_out(req.block_ids[:nb], slots)  # queued before any later use of the blocks being freed
        req.swap_slots, req.swapped_tokens = slots, n

    def _swapped_hit(self, req: Request) -> tuple[list[int], list[HostBlock | DiskBlock], int, int]:
        """_admit's lookup for a swapped request: a device prefix hit, the rest of its computed tokens from its
        slots (all but the last token: the model runs on it to sample)."""
        hit = self.cache.match(req)
        restore = min(req.swapped_tokens, req.num_tokens - 1)
        return hit, [], -1, max(restore, len(hit) * self._block_size)

    def _swap_in(self, req: Request, num_hit_blocks: int, num_hit: int, new_blocks: list[int]) -> None:
        """Queue the copies of the slots past the device hit into the request's first new blocks; its slots go
        back to the tier (the queue runs those copies before any later reuse)."""
        host = self.cache.host
        assert host is not None
        slots, req.swap_slots = req.swap_slots, []
        n = -(-num_hit // self._block_size) - num_hit_blocks
        host.swap_in(slots[num_hit_blocks:num_hit_blocks + n], new_blocks[:n])
        host.release_owned(slots)

    def _retire(self, req: Request, reason: FinishReason) -> None:
        if req.swap_slots:  # aborted while swapped out
            assert self.cache.host is not None
            self.cache.host.release_owned(req.swap_slots)
            req.swap_slots = []
        self._release_blocks(req)
        req.finish(reason)
        del self.requests[req.request_id]

    def _release_blocks(self, req: Request) -> None:
        if self._reserve is not None and req.status.is_running:  # every running request leaves through here
            self._reserve.released(req)
        # Tail first: the pool's LRU then evicts a sequence's last blocks before its shared prefix.
        self.pool.free(reversed(req.block_ids))
        if self.windows is not None:
            self.windows.free(req)
        req.block_ids = []
        req.num_stored_blocks = 0
        if req.known_to_workers:
            self._forget.append(req.request_id)
            req.known_to_workers = False
