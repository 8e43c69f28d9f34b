"""Admission that leaves room for output: SGLang's schedule_conservativeness and new_token_ratio (pure Python).

Admitting a waiting request while blocks are free fills the cache with prompts whose outputs do not fit later:
the running requests grow until the scheduler has to preempt (recompute) some of them. SGLang avoids that by
reserving, at admission, a fraction `new_token_ratio` of every running request's remaining output:

    admit  iff  free + evictable blocks  >=  blocks of the new request's uncached prompt
                                           + ratio x (the remaining outputs of the running requests
                                                      and of the new one) in blocks

A remaining output is max_output_tokens - generated (max_tokens, capped by what max_model_len leaves), clipped at
CLIP_MAX_NEW_TOKENS so that a request without max_tokens does not reserve its whole context. A request with
ignore_eos will produce all of it (only stop_token_ids or an abort end it sooner), so its output is reserved whole,
ratio 1, as SGLang's admission of ignore_eos requests counts it (PrefillAdder.add_one_req_ignore_eos); without that,
a benchmark of ignore_eos requests would be reserved ~0.1 of what it needs once the ratio has decayed, and preempt.
SGLang's check also simulates when each running request finishes and frees its blocks, which can admit earlier
than this sum; on the 1000-prompt Llama benchmark it admits nothing more (docs/benchmarks.md, eighth run), so the
O(1) sum is kept.
Where SGLang charges the request being admitted its whole clipped output, this charges it like the running ones:
it runs from the next step on and is reserved like them, and conservativeness 0 is exactly no reservation.

The ratio follows SGLang's schedule: it starts at init = min(INIT_NEW_TOKEN_RATIO x conservativeness, 1),
falls linearly on every step that runs requests to min = init x MIN_NEW_TOKEN_RATIO_FACTOR over
NEW_TOKEN_RATIO_DECAY_STEPS steps (most requests stop well before max_tokens, so a long-running server learns to
trust the pool), is reset to init when the engine has nothing to run, and when a step has to preempt it becomes
SGLang's retraction estimate: min(1, (tokens the still-running requests generated + RETRACT_DECODE_STEPS per
request) / (their max_output_tokens + 1)), the share of their outputs they have shown they do produce.

Cost: the sums are running totals kept by events (admitted, one token decoded, released), so an admission check
is O(1) however many requests run. A request in the middle of a chunked prefill has no reservation for the
prompt tokens it has yet to compute (its chunks take blocks as they come, as without the reservation).
"""
from __future__ import annotations

from collections.abc import Sequence

from appliance.engine.request import Request

# SGLang's environment defaults (SGLANG_INIT_NEW_TOKEN_RATIO, SGLANG_MIN_NEW_TOKEN_RATIO_FACTOR,
# SGLANG_NEW_TOKEN_RATIO_DECAY_STEPS, SGLANG_RETRACT_DECODE_STEPS, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION): kept
# equal so that a given --schedule-conservativeness means the same reservation in both engines.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
CLIP_MAX_NEW_TOKENS = 4096


class OutputReservation:
    """The ratio and the reservation sums of one scheduler; the scheduler reports every change of its running set.

    Events: admitted(req) when a request starts running, decoded(req) after each token appended to a running
    request, released(req) when a running request stops running (finished, aborted or preempted), step_done(running,
    preempted) once per planned step. Query: fits(req, spare_blocks, extra_tokens).
    """

    def __init__(self, conservativeness: float, block_size: int) -> None:
        if not conservativeness > 0:  # also refuses NaN
            raise ValueError(f"schedule_conservativeness must be > 0 for a reservation, got {conservativeness}")
        self.block_size = block_size
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.ratio = self.init_ratio
        self.num_running = 0
        self.estimated = 0  # sum of the clipped remaining outputs of the running requests that may stop early
        self.certain = 0  # the same sum over the ignore_eos ones: reserved whole (ratio 1)

    # ---- the running set ---------------------------------------------------------------------------------
    def admitted(self, req: Request) -> None:
        self._count(req, 1)

    def released(self, req: Request) -> None:
        self._count(req, -1)

    def _count(self, req: Request, sign: int) -> None:
        rest = sign * _clipped_remaining(req)
        if req.sampling_params.ignore_eos:
            self.certain += rest
        else:
            self.estimated += rest
        self.num_running += sign

    def decoded(self, req: Request) -> None:
        """One token was appended to a running request (called after append_output): once per token, keep it lean."""
        # its clipped remaining output min(max - g, CLIP) shrank by one unless it is still above the clip
        if req.max_output_tokens - len(req.output_token_ids) < CLIP_MAX_NEW_TOKENS:
            if req.sampling_params.ignore_eos:
                self.certain -= 1
            else:
                self.estimated -= 1

    # ---- the ratio ---------------------------------------------------------------------------------------
    def step_done(self, running: Sequence[Request], preempted: bool) -> None:
        """A step was planned; running: the requests still running. It ran requests: the ratio decays, or after a
        preemption becomes SGLang's retraction estimate (a loop over running, but preemptions are rare). It had
        nothing to run: the next requests start from the initial ratio again (SGLang's idle)."""
        if not running:
            self.ratio = self.init_ratio
        elif preempted:
            generated = sum(len(r.output_token_ids) for r in running)
            max_outputs = sum(r.max_output_tokens for r in running)
            self.ratio = min(1.0, (generated + RETRACT_DECODE_STEPS * len(running)) / (max_outputs + 1))
        else:
            self.ratio = max(self.ratio - self.decay, self.min_ratio)

    # ---- the question ------------------------------------------------------------------------------------
    def reserved_tokens(self, req: Request | None = None, extra_tokens: int = 0) -> float:
        """Tokens the running requests (and req, if given, as if admitted) are expected to need beyond what they
        hold: their remaining outputs (ratio x, ignore_eos ones whole), plus extra_tokens (req's prompt beyond its
        first chunk)."""
        certain, estimated = self.certain, self.estimated
        if req is not None:
            own = _clipped_remaining(req)
            if req.sampling_params.ignore_eos:
                certain += own
            else:
                estimated += own
        return extra_tokens + certain + self.ratio * estimated

    def fits(self, req: Request, spare_blocks: int, extra_tokens: int = 0) -> bool:
        """Whether req may be admitted when spare_blocks blocks stay free (or evictable) after its first chunk's
        blocks are taken. Nothing running: always (a request must be able to run alone)."""
        if self.num_running == 0:
            return True
        return self.reserved_tokens(req, extra_tokens) <= spare_blocks * self.block_size


def _clipped_remaining(req: Request) -> int:
    return min(req.max_output_tokens - len(req.output_token_ids), CLIP_MAX_NEW_TOKENS)
