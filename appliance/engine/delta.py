"""What the engine reports per request after a step: the records EngineCore.step() returns."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)  # slots: built per generated token, and cheaper to build with them
class TokenLogprob:
    """Logprob of one generated token, with the top alternatives when the request asked for them."""

    token_id: int
    logprob: float | None
    top_logprobs: tuple[tuple[int, float], ...] = ()  # (token id, logprob), best first
    rank: int | None = None  # 1-based rank of the token in the raw distribution (vLLM's Logprob.rank)


@dataclass(frozen=True, slots=True)  # slots: one is built per request per step, and cheaper to build with them
class RequestDelta:
    """What changed for one request in one step.

    new_logprobs is None unless the request set SamplingParams.logprobs; then it has one entry per new token.
    prompt_logprobs arrives once, in the delta that carries the first generated token, when asked for.
    finish_reason is "stop", "length", "error" (with `error`) or None (aborts are the caller's own doing and
    produce no delta).
    """

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    new_logprobs: tuple[TokenLogprob, ...] | None = None
    prompt_logprobs: tuple[tuple[tuple[int, float], ...] | None, ...] | None = None
    error: str | None = None  # finish_reason "error": the executor failed this request alone (SampledToken.error)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def followed_by(self, later: RequestDelta) -> RequestDelta:
        """This delta and the next one of the same request as one (a verification's several tokens)."""
        lps = None if self.new_logprobs is None else self.new_logprobs + (later.new_logprobs or ())
        return RequestDelta(self.request_id, self.new_token_ids + later.new_token_ids, later.finish_reason,
                            later.num_prompt_tokens, later.num_cached_tokens, lps, self.prompt_logprobs)
