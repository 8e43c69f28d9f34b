"""The step being planned (pure Python): what is left of its token budget, and the plan rows issued so far.

The token budget is config.chunked_prefill_size for everything a step issues (decodes included); once the decodes
are issued, a step that carries any takes at most config.max_mixed_prefill_tokens of prefill beside them
(cap_mixed_prefill), so no decode waits behind a longer prefill. With
chunking disabled (-1), decodes are bounded only by max_num_seqs, prompts are never split and prefills share
max_prefill_tokens, except that a longer prompt may run as the only prefill of its step.

The Scheduler decides which requests run and finds their blocks; a StepBudget sizes each request's chunk and
records it: the plan's rows, and in each request what was issued (num_computed_tokens advances when a step is
planned, a chunk that samples adds a pending token: see scheduler.py).
"""
from __future__ import annotations

from appliance.engine.request import Request
from appliance.engine.speculation import num_drafts
from appliance.engine.step import NewRequestData, ScheduledRequest

# A row of a step in flight: its ScheduledRequest, the request, the request's num_preemptions when planned (the
# incarnation the result belongs to) and the draft tokens it verifies (speculative decoding). A plain tuple, not a
# record class: one is built per row per step and Scheduler.update unpacks it, several times cheaper for a tuple.
Issued = tuple[ScheduledRequest, Request, int, int]


class StepBudget:
    """One step's planning state; built by Scheduler.schedule, which takes issue_seq back when planning ends."""

    def __init__(self, tokens: int, chunking: bool, num_spec: int, issue_seq: int) -> None:
        self.tokens = tokens  # shared budget (chunking) or prefill budget (no chunking)
        self.chunking = chunking
        self.num_spec = num_spec  # config.num_speculative_tokens
        self.first_issue_seq = issue_seq  # rows issued from here on (Request.last_issue_seq) are this step's
        self.issue_seq = issue_seq  # the scheduler's count of issued rows, lent for the step
        self.prefills = 0  # prefills scheduled in this step
        self.decodes = 0  # decode rows scheduled in this step
        self.preempted = False
        self.plan_new: list[NewRequestData] = []
        self.plan_sched: list[ScheduledRequest] = []
        self.issued: list[Issued] = []

    def chunk(self, req: Request, decodes: bool) -> int:
        """Tokens to compute for a running request this step (0: not this step)."""
        n = req.num_uncomputed_tokens
        if req.will_reach_length:
            return 0  # its in-flight sample is its last token
        if decodes:
            drafts = num_drafts(req, self.num_spec)
            if not self.chunking:
                return n + drafts  # no chunking: decodes are not charged to the prefill budget
            return n + min(drafts, self.tokens - n) if n <= self.tokens else 0
        return self.prefill_size(n)

    def cap_mixed_prefill(self, cap: int | None) -> None:
        """Called once the decodes are issued: prefill chunks still to plan get at most cap tokens if the step
        carries decodes (None: no cap)."""
        if cap is not None and self.decodes:
            self.tokens = min(self.tokens, cap)

    def prefill_size(self, n: int) -> int:
        """Tokens of a prefill of n uncomputed tokens that this step takes (0: not this step)."""
        if self.chunking:
            return min(n, self.tokens)
        if n <= self.tokens or self.prefills == 0:
            return n  # whole prompt; an over-budget one only as the step's first prefill
        return 0

    def issue_new(self, req: Request, n: int, restore_snapshot: int = -1, save_snapshot: int = -1,
                  window_tables: list[list[int]] | None = None) -> None:
        """Add a request that is new to the workers (or must be rebuilt) with its first chunk of n tokens; its
        table and num_computed_tokens (the prefix-cache hit) are set."""
        self.plan_new.append(
            NewRequestData(
                request_id=req.request_id,
                token_ids=req.all_token_ids,
                num_prompt_tokens=req.num_prompt_tokens,
                num_computed_tokens=req.num_computed_tokens,
                block_ids=list(req.block_ids),
                sampling=req.sampling_params.to_dict(),
                restore_snapshot=restore_snapshot,
                window_block_ids=[list(t) for t in window_tables or ()],
            )
        )
        req.known_to_workers = True
        self.issue(req, n, [], False, save_snapshot)

    def issue(self, req: Request, n: int, new_blocks: list[int], decodes: bool, save_snapshot: int = -1,
              new_window_blocks: list[list[int]] | None = None) -> None:
        """Add a chunk of n tokens to the plan; new_blocks (appended to the table) becomes the plan's own list,
        followed by new_window_blocks (appended to the sliding groups' tables: ScheduledRequest.new_block_ids)."""
        known = req.num_prompt_tokens + len(req.output_token_ids) + req.num_pending  # what the workers know
        end = req.num_computed_tokens + n
        # past the known tokens only by the drafts it verifies (speculative decoding)
        drafts = end - known if end > known else 0
        sample = end >= known
        if not decodes:
            self.prefills += 1
            self.tokens -= n
        else:
            self.decodes += 1
            if self.chunking:
                self.tokens -= n
        req.num_computed_tokens = end
        req.last_issue_seq = self.issue_seq
        self.issue_seq += 1
        if sample:  # its sample and, optimistically, every draft it verifies (overlap mode; scheduler.py)
            req.num_pending += 1 + drafts
        if new_window_blocks:
            new_blocks = new_blocks + [b for blocks in new_window_blocks for b in blocks]
        sched = ScheduledRequest(req.request_id, n, new_blocks, sample, save_snapshot)
        self.plan_sched.append(sched)
        self.issued.append((sched, req, req.num_preemptions, drafts))
