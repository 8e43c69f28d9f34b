"""Speculative decoding, the engine's side (pure Python): which requests verify drafts, and the counters.

Drafts live on the workers. After every step that samples a request, an MTP worker proposes
`num_speculative_tokens` (k) draft tokens for it and keeps them; the next step verifies d <= k of them: the
scheduler schedules the decode with num_tokens = 1 + d (and KV blocks for that lookahead plus the k - 1
positions the worker's next draft chain writes), and the worker answers with 1 to d + 1 SampledTokens of the
request, in order (the accepted drafts, then the target's own token at the first mismatch or after the last
draft). The scheduler applies them one by one under every stop rule and moves num_computed by the count.

A request whose sampling depends on processor state (structured outputs, thinking budget: extra keys the
workers' logits processors follow) is never verified: it decodes one token per step, as without drafts.
"""
from __future__ import annotations

from dataclasses import dataclass

from appliance.engine.sampling_params import SamplingParams

# SamplingParams.extra keys that give a request logits processors (executor/logits_processors.py): their
# matcher state would have to follow drafts that may be rejected
PROCESSOR_KEYS = ("structured", "thinking_budget")


def drafts_allowed(params: SamplingParams) -> bool:
    """Whether workers draft for this request and the scheduler lets it verify drafts."""
    extra = params.extra
    return not (extra and any(k in extra for k in PROCESSOR_KEYS))


@dataclass
class SpecCounters:
    """Cumulative over the engine's life (vLLM's spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens)."""

    num_drafts: int = 0  # verifications of at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted

    def as_tuple(self) -> tuple[int, int, int]:
        return self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens
