"""Whether a request thinks and for how long (server policy); the budget state machine is in structured/.

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
  to emit the end-of-thinking token sequence (ThinkingBudget.forced_token, in structured/thinking_budget.py: the
  state machine is shared with the executor), after which it samples freely.
"""
from __future__ import annotations

from dataclasses import dataclass

from appliance.structured.thinking_budget import ThinkingBudget

__all__ = ["REASONING_EFFORT_BUDGETS", "ThinkingBudget", "ThinkingDecision", "resolve_thinking"]

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
