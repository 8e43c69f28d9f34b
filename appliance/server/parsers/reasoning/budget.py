"""Whether a request thinks, for how long, and the state that ends thinking when the budget is spent.

Semantics (003_a3610789dfec711d.txt, Atlas `--disable-thinking` / `--max-thinking-budget`):
- The global switch api.disable_thinking wins over everything: thinking is off whatever the request asks.
- Otherwise the request decides (chat_template_kwargs.enable_thinking, or reasoning_effort="none" for off),
  then the model's default (on).
- The budget in tokens: the request's own (thinking.budget_tokens, else reasoning_effort mapped by
  REASONING_EFFORT_BUDGETS) wins below the server ceiling api.thinking_budget; with no request budget the
  ceiling applies. A safety cap of max_tokens * 9 // 10 is always enforced, so an answer always has room.
- A request whose output a grammar constrains from its first token (response_format, regex, choice, grammar,
  tool_choice "required" or named) does not think: pass structured_output=True. The grammar leaves no room for
  a reasoning block, and the template must then render the no-thinking prompt. (When the executor learns to
  apply grammars only after the reasoning, this rule can go.)
- Enforcement: once the request has produced `budget` tokens inside the reasoning block, the sampler is made
  to emit the end-of-thinking token sequence (ThinkingBudget.forced_token), after which it samples freely.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

# reasoning_effort -> budget tokens (None: no budget below the server ceiling). Our choice, documented here.
REASONING_EFFORT_BUDGETS: dict[str, int | None] = {
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": 16384,
    "xhigh": None,
}


@dataclass(frozen=True)
class ThinkingDecision:
    enabled: bool
    budget: int | None  # tokens of reasoning allowed; None = unlimited


def resolve_thinking(
    *,
    disable_thinking: bool = False,
    enable_thinking: bool | None = None,
    reasoning_effort: str | None = None,
    budget_tokens: int | None = None,
    max_thinking_budget: int | None = None,
    max_tokens: int | None = None,
    default_enabled: bool = True,
    structured_output: bool = False,
) -> ThinkingDecision:
    """Combine the server settings and one request's fields into a decision (ValueError on bad input)."""
    if reasoning_effort is not None and reasoning_effort != "none" and reasoning_effort not in REASONING_EFFORT_BUDGETS:
        raise ValueError(
            f"reasoning_effort must be one of none, {', '.join(REASONING_EFFORT_BUDGETS)}; got {reasoning_effort!r}"
        )
    for label, value in (("budget_tokens", budget_tokens), ("thinking_budget", max_thinking_budget)):
        if value is not None and value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")
    if disable_thinking or structured_output:
        return ThinkingDecision(enabled=False, budget=None)
    if enable_thinking is not None:
        enabled = enable_thinking
    elif reasoning_effort == "none":
        enabled = False
    else:
        enabled = default_enabled
    if not enabled:
        return ThinkingDecision(enabled=False, budget=None)
    requested = budget_tokens
    if requested is None and reasoning_effort is not None:
        requested = REASONING_EFFORT_BUDGETS.get(reasoning_effort)
    caps = [b for b in (requested, max_thinking_budget) if b is not None]
    if max_tokens is not None:
        caps.append(max_tokens * 9 // 10)
    return ThinkingDecision(enabled=True, budget=min(caps) if caps else None)


class ThinkingBudget:
    """Per-request state the sampler consults: `observe` every generated token, ask `forced_token` before sampling.

    Tags are matched as token-id sequences (in Qwen3, DeepSeek R1 and Kimi `<think>` and `</think>` are single
    special tokens). `end_token_ids` is what is forced when the budget is spent: at least the end tag, e.g.
    tokenizer.encode("\n</think>\n\n"); `end_tag_ids` (default: end_token_ids) is what marks a natural end.
    With budget None nothing is forced and the object only tracks `in_reasoning`, e.g. so that a structured-output
    grammar is applied only to the answer after the reasoning.
    """

    def __init__(
        self,
        budget: int | None,
        *,
        end_token_ids: Sequence[int],
        start_tag_ids: Sequence[int] = (),
        end_tag_ids: Sequence[int] | None = None,
        in_reasoning: bool = False,
    ) -> None:
        if budget is not None and budget < 0:
            raise ValueError(f"budget must be >= 0, got {budget}")
        if not end_token_ids:
            raise ValueError("end_token_ids must not be empty")
        self.budget = budget
        self._forced_sequence = tuple(end_token_ids)
        self._start = tuple(start_tag_ids)
        self._end = tuple(end_tag_ids) if end_tag_ids is not None else self._forced_sequence
        self._in_reasoning = in_reasoning
        self._count = 0
        self._recent: deque[int] = deque(maxlen=max(len(self._start), len(self._end), 1))
        self._forcing: deque[int] = deque()
        self._exhausted = False

    @property
    def in_reasoning(self) -> bool:
        return self._in_reasoning

    @property
    def reasoning_tokens(self) -> int:
        return self._count

    @property
    def exhausted(self) -> bool:
        """The budget ran out and the end of thinking was (or is being) forced."""
        return self._exhausted

    def forced_token(self) -> int | None:
        """The token the sampler must produce next, or None to sample freely."""
        spent = self.budget is not None and self._count >= self.budget
        if spent and not self._forcing and self._in_reasoning and not self._exhausted:
            self._exhausted = True
            self._forcing.extend(self._forced_sequence)
        return self._forcing[0] if self._forcing else None

    def observe(self, token_id: int) -> None:
        if self._forcing:
            if token_id != self._forcing[0]:
                raise ValueError(f"the sampler produced {token_id} where the thinking budget forced {self._forcing[0]}")
            self._forcing.popleft()
            if not self._forcing:
                self._in_reasoning = False
                self._recent.clear()
            return
        self._recent.append(token_id)
        if self._in_reasoning:
            self._count += 1
            if self._end and tuple(self._recent)[-len(self._end) :] == self._end:
                self._in_reasoning = False
                self._recent.clear()
        elif self._start and not self._exhausted and tuple(self._recent)[-len(self._start) :] == self._start:
            self._in_reasoning = True
            self._recent.clear()
