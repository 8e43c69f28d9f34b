"""The per-request state machine that ends thinking once a token budget is spent.

A pure token-id state machine shared by both layers: the server builds one to describe a request's budget
(server/parsers/reasoning/budget.py decides the budget), the workers' ThinkingBudgetProcessor
(executor/logits_processors.py) drives it while sampling. Once the request has produced `budget` tokens inside
the reasoning block, the sampler is made to emit the end-of-thinking token sequence (`forced_token`), after which
it samples freely.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Sequence


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
