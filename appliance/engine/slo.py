"""scheduler.policy = "slo": keep decoding requests within their time-between-tokens deadline (scheduler.slo_tbt_ms)
while prompts arrive (pure Python; the Scheduler asks it, see scheduler.py).

- Decodes always come first in a step (as with every policy). What slo adds: each decoding request's deadline is
  its last token's time + slo_tbt_ms; the step's prefill tokens are capped so the step's predicted duration stays
  within the smallest slack (deadline - now) of the requests it decodes. A request already past its deadline
  leaves no room: that step decodes only. When more requests decode than the budget holds, the nearest deadline
  goes first (instead of round-robin).
- Prefills shortest-first: waiting requests by (priority, uncomputed tokens, arrival), running chunked prefills by
  (priority, uncomputed tokens). Preempted requests still go first.
- Per-request priority (vLLM's `priority`: lower is served first, default 0) orders waiting and prefilling requests
  and picks the preemption victim: the lowest priority (largest value) not yet scheduled, newest among equals.

The step's duration is predicted by a cost model the scheduler measures while it runs: seconds = base + per_token x
prefill tokens, base from steps without prefill and per_token from steps with one, each an exponential moving
average of the observed durations (a step's duration = its results' arrival - max(its planning, the previous
results' arrival), which also holds with one step in flight). Until both are measured nothing is capped.
"""
from __future__ import annotations

from dataclasses import dataclass

from appliance.engine.request import Request

EWMA = 0.2  # weight of the newest observation: follows a changed batch within ~10 steps


@dataclass
class StepCostModel:
    """seconds(step) = base_s + per_token_s x prefill tokens, measured online."""

    base_s: float | None = None
    per_token_s: float | None = None

    def observe(self, seconds: float, prefill_tokens: int) -> None:
        if seconds <= 0:
            return
        if prefill_tokens == 0:
            self.base_s = seconds if self.base_s is None else (1 - EWMA) * self.base_s + EWMA * seconds
        elif self.base_s is not None:
            per = max(seconds - self.base_s, 0.0) / prefill_tokens
            self.per_token_s = per if self.per_token_s is None else (1 - EWMA) * self.per_token_s + EWMA * per

    def prefill_room(self, slack_s: float) -> int | None:
        """Prefill tokens a step can add and still end within slack_s; None while unmeasured."""
        if self.base_s is None or self.per_token_s is None:
            return None
        left = slack_s - self.base_s
        if left <= 0:
            return 0
        return int(left / self.per_token_s) if self.per_token_s > 0 else None


class SloPolicy:
    def __init__(self, tbt_s: float) -> None:
        self.tbt_s = tbt_s
        self.cost = StepCostModel()

    def deadline(self, req: Request) -> float:
        """Its last token's time + slo_tbt; none (inf) before its first token, or since a preemption."""
        t = req.last_token_time
        return float("inf") if t is None else t + self.tbt_s

    def prefill_cap(self, decoding: list[Request], now: float) -> int | None:
        """The most prefill tokens this step may take given the decodes it carries; None: no cap."""
        deadline = min((self.deadline(r) for r in decoding), default=float("inf"))
        return None if deadline == float("inf") else self.cost.prefill_room(deadline - now)

    @staticmethod
    def waiting_key(req: Request) -> tuple[int, int, float]:
        return (req.sampling_params.priority, req.num_tokens - req.num_computed_tokens, req.arrival_time)

    @staticmethod
    def prefill_key(req: Request) -> tuple[int, int]:
        return (req.sampling_params.priority, req.num_uncomputed_tokens)

    def decode_key(self, req: Request) -> tuple[float, int]:
        return (self.deadline(req), req.sampling_params.priority)
