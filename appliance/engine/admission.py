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
When that sum says no to an ignore_eos request, SGLang's second check decides (PrefillAdder.add_one_req_ignore_eos):
the running requests' finishes are simulated in order, each growing one token per step until its output is done,
and the request is admitted if the pool covers the peak of that schedule: just before each finish, every request
still running has grown by the finisher's remaining output, and the finished ones have given their blocks back.
The sum reserves every output at once, though the shortest finish first; with a staggered running set (a small
step budget, as recipes/llama-3.1-8b.toml's chunked_prefill_size 640) the simulation admits up to the seat limit where the sum stops
at what the pool holds with every output whole. Requests decode one token a step (the scheduler plans decodes
first); prompts still to prefill go in at the step budget left beside the decode rows (at most
max_mixed_prefill_tokens). A block of margin per
request covers a step off either way, and preemption stays the backstop. O(running) with a sort, only when the
sum refuses.
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

from collections.abc import Callable, Sequence

from appliance.engine.request import Request, RequestStatus

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

    def __init__(self, conservativeness: float, block_size: int, running: Sequence[Request] = (),
                 shared_blocks: Callable[[Request], int] = lambda r: 0,
                 step_tokens: int = 1 << 30, mixed_prefill_tokens: int | None = None) -> None:
        """For the finish-time check (read, never changed here): running, the scheduler's running list;
        shared_blocks(req), how many of req's first blocks other requests hold too (its finish keeps them);
        step_tokens, the step token budget; mixed_prefill_tokens, the prefill a step that decodes takes at most
        (scheduler.max_mixed_prefill_tokens, None: no bound)."""
        if not conservativeness > 0:  # also refuses NaN
            raise ValueError(f"schedule_conservativeness must be > 0 for a reservation, got {conservativeness}")
        self.block_size = block_size
        self.running = running
        self.shared_blocks = shared_blocks
        self.step_tokens = step_tokens
        self.mixed_prefill_tokens = mixed_prefill_tokens
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

    def fits(self, req: Request, spare_blocks: int, extra_tokens: int = 0, hit: Sequence[int] = ()) -> bool:
        """Whether req may be admitted when spare_blocks blocks stay free (or evictable) after its first chunk's
        blocks are taken. Nothing running: always (a request must be able to run alone)."""
        if self.num_running == 0:
            return True
        if self.reserved_tokens(req, extra_tokens) <= spare_blocks * self.block_size:
            return True
        return req.sampling_params.ignore_eos and self.fits_by_finish_time(req, spare_blocks, extra_tokens, hit)

    def fits_by_finish_time(self, req: Request, spare_blocks: int, extra_tokens: int = 0,
                            hit: Sequence[int] = ()) -> bool:
        """SGLang's simulation (module docstring), the running requests and req in the order they finish: a
        request decodes one token per step once its prompt is in, and prompts go in first come first served at
        the step budget left beside one decode row per request. Just before each finishes, every request still
        running has grown by as many tokens as steps have passed (a bound: one still prefilling grows less), plus
        one block of rounding margin each, and must fit in spare_blocks plus what the finished ones gave back (the
        blocks only they held: a shared prefix stays with its other holders, req among them for its prefix hits,
        the block ids `hit`). Outputs that may stop early count ratio x their clipped remainder, as in the sum."""
        bs = self.block_size
        share = self.step_tokens - len(self.running) - 1  # prompt tokens a step takes beside the decode rows
        if self.mixed_prefill_tokens is not None:
            share = min(share, self.mixed_prefill_tokens)
        if share <= 0:
            return False  # prompts would wait behind decodes: no finish time to simulate
        rows = []  # (steps until it finishes, tokens now, blocks held, blocks its finish gives back)
        queued = 0  # prompt tokens ahead of a request (first come first served)
        for r in self.running:
            done = len(r.output_token_ids) + r.num_pending
            left: float = r.max_output_tokens - done
            if not r.sampling_params.ignore_eos:
                left = self.ratio * min(left, CLIP_MAX_NEW_TOKENS)
            if r.status is RequestStatus.PREFILLING:
                queued += r.num_uncomputed_tokens
            if left > 0:
                rows.append((left + _prefill_steps(queued, share), r.num_prompt_tokens + done, len(r.block_ids),
                             len(r.block_ids) - max(self.shared_blocks(r), _common_prefix(r.block_ids, hit))))
        first_chunk = -(-(req.num_tokens - extra_tokens) // bs)  # the blocks req holds once admitted
        rows.append((req.max_output_tokens - len(req.output_token_ids) + _prefill_steps(queued + extra_tokens, share),
                     req.num_tokens, first_chunk, first_chunk - len(hit)))
        rows.sort()
        tokens, held, alive, freed = sum(r[1] for r in rows), sum(r[2] for r in rows), len(rows), 0
        for steps, now, blocks, own in rows:
            if spare_blocks + freed < (tokens + alive * steps) / bs + alive - held:
                return False
            freed, tokens, held, alive = freed + own, tokens - now, held - blocks, alive - 1
        return True


def _prefill_steps(queued: int, share: int) -> int:
    """Steps a prompt adds to a request's finish when `queued` prompt tokens (its own last) go in at `share` a
    step: the last chunk's step also samples the first output, so one less than the chunks. (Off by at most a
    step either way, which the block of margin per request covers.)"""
    return max(0, -(-queued // share) - 1)


def _common_prefix(blocks: Sequence[int], hit: Sequence[int]) -> int:
    """How many first blocks the two tables share (a prefix hit shares a table's first blocks)."""
    if not hit or not blocks or blocks[0] != hit[0]:
        return 0
    n = 1
    while n < len(hit) and n < len(blocks) and blocks[n] == hit[n]:
        n += 1
    return n


def _clipped_remaining(req: Request) -> int:
    return min(req.max_output_tokens - len(req.output_token_ids), CLIP_MAX_NEW_TOKENS)
