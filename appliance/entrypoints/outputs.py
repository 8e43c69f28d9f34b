"""Result records of the offline API, shaped like vLLM's RequestOutput / CompletionOutput / Logprob."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely under the raw distribution; None when not known
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None  # "stop" or "length"
    stop_reason: int | str | None = None  # the stop string, or the stop token id, that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
