"""Per-request logits processors: constraints on which token a request may sample next.

A request asks for them through SamplingParams.extra (set by the server or the offline LLM):
- extra["structured"]: a StructuredSpec.to_dict() -> GrammarProcessor (xgrammar token bitmask; the grammar
  ends with one of the model's EOS ids, so the request finishes with "stop" when the grammar is complete);
- extra["thinking_budget"]: {"budget", "end_token_ids", "start_tag_ids", "end_tag_ids", "in_reasoning"} ->
  ThinkingBudgetProcessor (forces the end-of-thinking sequence once `budget` reasoning tokens exist).

Each step the runner calls `sample(runner, logits, states)` instead of its batch sampler: rows whose processors
constrain this step are masked in place and drawn by the torch Sampler (whose filters all honour -inf; the
Triton fast path is kept for the others), the others go through the batch sampler unchanged. A thinking budget
constrains only the steps that force the end of thinking.
Processors observe sampled tokens lazily: before masking a row they catch up with the tokens the request
gained since (state.token_ids), so a preempted request rebuilt from its tokens replays them the same way.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from appliance.executor.request_table import RequestState
from appliance.executor.sampler import SampleResult
from appliance.structured.thinking_budget import ThinkingBudget

if TYPE_CHECKING:
    from appliance.executor.runner_protocol import ModelRunnerProtocol

log = logging.getLogger(__name__)

_NEG_INF = float("-inf")


class LogitsProcessor(Protocol):
    def mask_row(self, row: torch.Tensor) -> bool:
        """Set the logits of tokens that may not come next to -inf, in place (row: [vocab]); False when this
        step leaves the row alone (the row may then take the batch sampler's fast paths)."""

    def observe(self, token_id: int) -> None:
        """The token this request sampled (always after a mask_row of the same step)."""


def force_token(row: torch.Tensor, token_id: int) -> None:
    """Only `token_id` may come next (its logit becomes 0: probability 1 after the mask)."""
    row.fill_(_NEG_INF)
    row[token_id] = 0.0


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [..., ceil(vocab/32)] (bit j of word i: token 32*i+j allowed) -> bool [..., vocab]."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab].bool()


class GrammarProcessor:
    """Follows an appliance.structured GrammarMatcher; once the grammar is complete (or broken) forces EOS."""

    def __init__(self, matcher: Any, eos_token_id: int) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id
        self.broken = False
        self._advanced: list[bool] = []  # speculate() calls since the last rollback(): did the matcher move

    def mask_row(self, row: torch.Tensor) -> bool:
        if self.broken or self.matcher.is_terminated():
            force_token(row, self.eos_token_id)
            return True
        width = min(row.shape[0], self.matcher.vocab_size)
        allowed = unpack_bitmask(self.matcher.allowed_token_bitmask().to(row.device), width)
        row[:width].masked_fill_(~allowed, _NEG_INF)
        row[width:] = _NEG_INF
        return True

    def observe(self, token_id: int) -> None:
        if self.broken or self.matcher.is_terminated():
            return
        if not self.matcher.accept_token(token_id):
            # only possible if something bypassed the mask; end the request rather than emit invalid output
            log.error("token %d breaks the request's grammar; ending the request", token_id)
            self.broken = True

    def speculate(self, token_id: int) -> bool:
        """Advance over a draft token if the grammar allows it (undone by `rollback`); False when it does not."""
        if self.broken or self.matcher.is_terminated():
            self._advanced.append(False)
            return token_id == self.eos_token_id
        ok = self.matcher.accept_token(token_id)
        self._advanced.append(ok)
        return ok

    def rollback(self) -> None:
        """Undo every `speculate` since the last rollback."""
        n = sum(self._advanced)
        if n:
            self.matcher.rollback(n)
        self._advanced = []


class ThinkingBudgetProcessor:
    """Applies a ThinkingBudget: while it forces the end of thinking, only the forced token may come."""

    def __init__(self, budget: ThinkingBudget) -> None:
        self.budget = budget

    def mask_row(self, row: torch.Tensor) -> bool:
        forced = self.budget.forced_token()
        if forced is None or not 0 <= forced < row.shape[0]:
            return False
        force_token(row, forced)
        return True

    def observe(self, token_id: int) -> None:
        self.budget.observe(token_id)


class FinishNow:
    """For a request whose processors could not be built in the worker: end it at once with EOS."""

    def __init__(self, eos_token_id: int, reason: str) -> None:
        self.eos_token_id = eos_token_id
        self.reason = reason

    def mask_row(self, row: torch.Tensor) -> bool:
        force_token(row, self.eos_token_id)
        return True

    def observe(self, token_id: int) -> None:
        pass

    def speculate(self, token_id: int) -> bool:
        return token_id == self.eos_token_id

    def rollback(self) -> None:
        pass


def wants_processors(extra: Mapping[str, Any]) -> bool:
    return bool(extra) and ("structured" in extra or "thinking_budget" in extra)


def thinking_budget_from_dict(d: Mapping[str, Any], prompt_ids: Sequence[int]) -> ThinkingBudget:
    """The ThinkingBudget for extra["thinking_budget"]; `in_reasoning` defaults to what the prompt's tail says."""
    start, end = tuple(d.get("start_tag_ids") or ()), tuple(d.get("end_tag_ids") or d["end_token_ids"])
    in_reasoning = d.get("in_reasoning")
    if in_reasoning is None:
        in_reasoning = _last_index(prompt_ids, start) > _last_index(prompt_ids, end) if start else False
    return ThinkingBudget(d.get("budget"), end_token_ids=list(d["end_token_ids"]), start_tag_ids=start,
                          end_tag_ids=end, in_reasoning=bool(in_reasoning))


def _last_index(ids: Sequence[int], seq: tuple[int, ...]) -> int:
    n = len(seq)
    for i in range(len(ids) - n, -1, -1):
        if tuple(ids[i : i + n]) == seq:
            return i
    return -1


@dataclass
class _Entry:
    state: RequestState  # identity: a preempted request comes back as a new state and gets new processors
    processors: list[LogitsProcessor]
    seen: int = 0  # output tokens observed so far


@dataclass
class LogitsProcessors:
    """The processors of one worker's live requests, built on a request's first constrained step."""

    load_tokenizer: Callable[[], Any]
    vocab_size: int
    eos_token_ids: Sequence[int]
    live: Mapping[str, RequestState]  # the runner's request table (to forget finished requests)
    _entries: dict[str, _Entry] = field(default_factory=dict)
    _compiler: Any = None

    @classmethod
    def for_runner(cls, runner: ModelRunnerProtocol) -> LogitsProcessors:
        m = runner.config.model

        def load() -> Any:
            from appliance.config import resolve_model_path
            from appliance.tokenization import load_tokenizer

            if m.skip_tokenizer_init:
                raise ValueError("structured outputs need the tokenizer (model.skip_tokenizer_init is set)")
            return load_tokenizer(m.tokenizer or resolve_model_path(m.path), mode=m.tokenizer_mode,
                                  trust_remote_code=m.trust_remote_code, revision=m.revision,
                                  download_dir=m.download_dir)

        vocab = int(getattr(runner.hf_config, "vocab_size", 0) or 0)
        return cls(load, vocab, list(runner.eos_token_ids), runner.requests)

    @property
    def compiler(self) -> Any:
        """One GrammarCompiler per worker (its LRU cache compiles each spec once), built on first use."""
        if self._compiler is None:
            from appliance.structured import GrammarCompiler

            self._compiler = GrammarCompiler.from_tokenizer(self.load_tokenizer(), vocab_size=self.vocab_size or None,
                                                            stop_token_ids=list(self.eos_token_ids) or None)
        return self._compiler

    def build(self, state: RequestState) -> list[LogitsProcessor]:
        extra = state.params.extra
        eos = self.eos_token_ids[0] if self.eos_token_ids else 0
        out: list[LogitsProcessor] = []
        try:
            if extra.get("thinking_budget") is not None:
                prompt = state.token_ids[: state.num_prompt_tokens]
                out.append(ThinkingBudgetProcessor(thinking_budget_from_dict(extra["thinking_budget"], prompt)))
            if extra.get("structured") is not None:
                from appliance.structured import GrammarMatcher, StructuredSpec

                matcher = GrammarMatcher(self.compiler.compile(StructuredSpec.from_dict(extra["structured"])))
                out.append(GrammarProcessor(matcher, eos))
        except Exception as exc:  # noqa: BLE001 - one bad request must not take the worker down
            log.error("request %s: cannot build its logits processors (%s); ending it", state.request_id, exc)
            return [FinishNow(eos, str(exc))]
        return out

    def _entry(self, state: RequestState) -> _Entry:
        entry = self._entries.get(state.request_id)
        if entry is None or entry.state is not state:
            entry = _Entry(state, self.build(state))
            self._entries[state.request_id] = entry
        return entry

    def _forget_finished(self) -> None:
        for rid in [r for r, e in self._entries.items() if self.live.get(r) is not e.state]:
            del self._entries[rid]

    def mask_drafts(self, logits: torch.Tensor, state: RequestState, num_drafts: int) -> None:
        """Mask the d + 1 rows of a verification in place (speculative decoding: state.token_ids ends with its d
        drafts): row j as after the confirmed tokens and the first j drafts. The processors advance over the
        drafts and are rolled back; rows after a draft the grammar refuses are left alone (that draft's row,
        masked, cannot sample it, so they are never emitted). Requests whose processors cannot roll back
        (a thinking budget) never get drafts (engine/speculation.py drafts_allowed)."""
        entry = self._entry(state)
        confirmed = len(state.token_ids) - num_drafts
        for token in state.token_ids[state.num_prompt_tokens + entry.seen : confirmed]:
            for p in entry.processors:
                p.observe(token)
        entry.seen = confirmed - state.num_prompt_tokens
        procs: list[Any] = entry.processors
        try:
            for j, draft in enumerate([*state.token_ids[confirmed:], None]):
                for p in procs:
                    p.mask_row(logits[j])
                if draft is None or not all([p.speculate(draft) for p in procs]):
                    break
        finally:
            for p in procs:
                p.rollback()

    def mask(self, logits: torch.Tensor, states: Sequence[RequestState]) -> list[int]:
        """Mask the rows whose requests' processors constrain this step (in place); returns those rows."""
        if self._entries:
            self._forget_finished()
        rows: list[int] = []
        for i, state in enumerate(states):
            if not wants_processors(state.params.extra):
                continue
            entry = self._entry(state)
            start = state.num_prompt_tokens + entry.seen
            for token in state.token_ids[start:]:
                for p in entry.processors:
                    p.observe(token)
            entry.seen = len(state.token_ids) - state.num_prompt_tokens
            masked = [p.mask_row(logits[i]) for p in entry.processors]
            if any(masked):
                rows.append(i)
        return rows


def processors_for(runner: ModelRunnerProtocol) -> LogitsProcessors:
    if runner.logits_processors is None:
        runner.logits_processors = LogitsProcessors.for_runner(runner)
    return runner.logits_processors


def forget_idle(runner: ModelRunnerProtocol) -> None:
    """A step without constrained rows: drop the processors of requests that finished meanwhile."""
    idle = runner.logits_processors
    if idle is not None and idle._entries:
        idle._forget_finished()


def sample(runner: ModelRunnerProtocol, logits: torch.Tensor, states: Sequence[RequestState]) -> list[SampleResult]:
    """The runner's batch sampler, with constrained rows masked and drawn by the torch Sampler."""
    batch_sampler = runner.batch_sampler
    if not any(wants_processors(s.params.extra) for s in states):
        forget_idle(runner)
        return batch_sampler(logits, states)
    return draw(batch_sampler, logits, states, processors_for(runner).mask(logits, states))


def draw(batch_sampler: Any, logits: torch.Tensor, states: Sequence[Any], rows: list[int]) -> list[SampleResult]:
    """Sample every row, the masked `rows` with the torch Sampler (the Triton fast path ignores masks)."""
    if not rows or batch_sampler.gpu_op is None:  # on the CPU every path (argmax, torch Sampler) honours masks
        return batch_sampler(logits, states)
    from appliance.executor.batch_sampler import sampling_row

    results: list[SampleResult | None] = [None] * len(states)
    constrained = set(rows)
    free = [i for i in range(len(states)) if i not in constrained]
    idx = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    for i, r in zip(rows, batch_sampler.sampler(logits[idx].float(), [sampling_row(states[i]) for i in rows])):
        results[i] = r
    if free:
        sub = logits[torch.tensor(free, dtype=torch.int64, device=logits.device)]
        for i, r in zip(free, batch_sampler(sub, [states[i] for i in free])):
            results[i] = r
    return results  # type: ignore[return-value]
