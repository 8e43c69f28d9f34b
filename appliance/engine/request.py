"""A generation request as an explicit finite-state machine (pure Python, no torch).

States and the only legal moves between them:

    WAITING ----> PREFILLING ----> DECODING ----> FINISHED (stop | length)
       |             |                |
       |             +--> PREEMPTED <-+              PREEMPTED --> PREFILLING (recompute)
       +--> ABORTED  +--> ABORTED     +--> ABORTED   PREEMPTED --> ABORTED

PREEMPTED is a waiting state: the request lost its KV blocks and sits at the front of the queue until it is
recomputed (prompt and the tokens generated so far). A request enters DECODING when its last prefill chunk
samples a token, so the first token's finish check happens in DECODING too. FINISHED and ABORTED are
terminal. Any other move is a bug in the caller and raises `IllegalTransition` instead of being ignored.

One request produces one sequence: parallel sampling (`SamplingParams.n > 1`) is fanned out above the engine
(the API layer submits n requests with distinct ids and seeds), so the engine never sees n.
"""
from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from appliance.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    PREFILLING = "prefilling"
    DECODING = "decoding"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_running(self) -> bool:
        return self in (RequestStatus.PREFILLING, RequestStatus.DECODING)

    @property
    def is_waiting(self) -> bool:
        return self in (RequestStatus.WAITING, RequestStatus.PREEMPTED)

    @property
    def is_done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.ABORTED)


# The per-token paths (scheduler, append_output) compare against these: a member lookup on the enum class
# (RequestStatus.DECODING) costs a class attribute lookup each time, several times a module global's.
PREFILLING = RequestStatus.PREFILLING
DECODING = RequestStatus.DECODING
PREEMPTED = RequestStatus.PREEMPTED


class FinishReason(str, enum.Enum):
    """OpenAI's finish_reason values; the string value is what goes on the wire."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_S = RequestStatus
LEGAL_TRANSITIONS: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.WAITING: frozenset({_S.PREFILLING, _S.ABORTED}),
    _S.PREFILLING: frozenset({_S.DECODING, _S.PREEMPTED, _S.ABORTED}),
    _S.DECODING: frozenset({_S.FINISHED, _S.PREEMPTED, _S.ABORTED}),
    _S.PREEMPTED: frozenset({_S.PREFILLING, _S.ABORTED}),
    _S.FINISHED: frozenset(),
    _S.ABORTED: frozenset(),
}


class IllegalTransition(RuntimeError):
    """A request was asked to move between two states that the state machine does not connect."""

    def __init__(self, request_id: str, src: RequestStatus, dst: RequestStatus) -> None:
        super().__init__(f"request {request_id!r}: illegal transition {src.value} -> {dst.value}")
        self.request_id = request_id
        self.src = src
        self.dst = dst


def exact_ints(values: Iterable[Any]) -> bool:
    """Whether every value's type is exactly int (no bool, no numpy int), checked by one C-level scan: prompts
    of thousands of ids arrive in bursts, and a Python loop per id stalls the step being planned."""
    return _INT.issuperset(map(type, values))


_INT = frozenset({int})


@dataclass(eq=False)  # a request is an identity, not a value: running.remove(req) compares by `is` only
class Request:
    """One request's engine-side state. Mutated only by the scheduler (and EngineCore through it).

    The prompt, sampling params and max_model_len never change after creation, so what follows from them alone
    (num_prompt_tokens, max_output_tokens) is computed once: the scheduler reads it for every request each step.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 62
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or being written by the running step)
    num_cached_tokens: int = 0  # prefix-cache hit of the first admission, reported to the client
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of full blocks, filled lazily
    num_stored_blocks: int = 0  # leading blocks of block_ids already offered to the prefix cache
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    # a swapped request (engine/swap.py): the host slots holding its first blocks, and how many tokens they hold
    swap_slots: list[int] = field(default_factory=list)
    swapped_tokens: int = 0
    last_issue_seq: int = -1  # when it was last scheduled (a scheduler counter): round-robin of decodes
    last_token_time: float | None = None  # scheduler clock at its last token (policy slo's deadline); None: none yet
    known_to_workers: bool = False  # workers hold its state (sent as new, not yet told to forget)
    # tokens sampled by steps in flight, not yet appended (overlap mode; 0 when synchronous); a verification in
    # flight counts 1 + its drafts, as if all were accepted (engine/speculation.py)
    num_pending: int = 0
    num_drafts_held: int = 0  # drafts the workers hold for it (speculative decoding: the last StepResult.drafts)
    prompt_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    prompt_logprobs_done: bool = False
    num_prompt_tokens: int = field(init=False, repr=False)
    max_output_tokens: int = field(init=False, repr=False)  # max_tokens, capped by what max_model_len leaves

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt is empty")
        ids = self.prompt_token_ids
        if (min(ids) < 0) if exact_ints(ids) else any((not isinstance(t, int)) or t < 0 for t in ids):
            raise ValueError(f"request {self.request_id!r}: token ids must be non-negative ints")
        self.num_prompt_tokens = len(self.prompt_token_ids)
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.sampling_params.max_tokens
        self.max_output_tokens = max(1, room if mt is None else min(mt, room))
        if self.num_prompt_tokens > self.max_model_len:
            raise ValueError(
                f"request {self.request_id!r}: prompt has {self.num_prompt_tokens} tokens, more than "
                f"max_model_len={self.max_model_len}"
            )

    # ---- token views -------------------------------------------------------------------------------------
    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output without building the whole list."""
        p = self.num_prompt_tokens
        if stop <= p:
            return self.prompt_token_ids[start:stop]
        if start >= p:
            return self.output_token_ids[start - p : stop - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - p]

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the workers know (pending samples included) whose KV is not computed or being computed."""
        return self.num_tokens + self.num_pending - self.num_computed_tokens

    @property
    def will_reach_length(self) -> bool:
        """The pending samples alone finish it by length: a further step would compute past the end (with a
        verification in flight: would if all its drafts are accepted; if not, a later plan continues it)."""
        n = self.num_pending
        if not n:
            return False
        n_out = len(self.output_token_ids)
        return n_out + n >= self.max_output_tokens or self.num_prompt_tokens + n_out + n >= self.max_model_len

    # ---- state machine -----------------------------------------------------------------------------------
    def transition(self, dst: RequestStatus) -> None:
        if dst not in LEGAL_TRANSITIONS[self.status]:
            raise IllegalTransition(self.request_id, self.status, dst)
        self.status = dst

    def finish(self, reason: FinishReason) -> None:
        dst = RequestStatus.ABORTED if reason is FinishReason.ABORT else RequestStatus.FINISHED
        self.transition(dst)
        self.finish_reason = reason

    def append_output(self, token_id: int) -> FinishReason | None:
        """Record a sampled token; return the finish reason it causes, or None to keep going.

        eos and stop_token_ids count only once min_tokens tokens exist (the sampler is expected to mask them
        before that; if it does not, the engine still does not stop early). The stop token stays in the
        output, like vLLM; the detokenizer decides whether to show it.
        """
        if self.status is not DECODING:
            raise IllegalTransition(self.request_id, self.status, DECODING)
        out = self.output_token_ids
        out.append(token_id)
        sp = self.sampling_params
        n_out = len(out)
        if n_out >= sp.min_tokens:
            if token_id in sp.stop_token_ids:
                return FinishReason.STOP
            if not sp.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
        if n_out >= self.max_output_tokens or self.num_prompt_tokens + n_out >= self.max_model_len:
            return FinishReason.LENGTH
        return None
