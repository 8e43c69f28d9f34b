"""Verification of drafts: a request's d drafts are scored by d + 1 target rows, each sampled with the drafts
before it as history, and the longest matching prefix is kept plus the first sample that differs (the rejection
sampling of a one-hot draft; speculative.py's top explains why every emitted token is the target's)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from appliance.executor.request_table import RequestState
from appliance.executor.sampler import SampleResult
from appliance.executor.speculative_forced import ForcedAcceptance


class _VerifyRow:
    """A verification row as the sampler sees a request: its history is the confirmed tokens plus the first
    `j` drafts (token lists are built only when a sampling path reads them)."""

    def __init__(self, state: RequestState, end: int) -> None:
        self.state, self.end = state, end
        self.request_id, self.params, self.noise_seed = state.request_id, state.params, state.noise_seed
        self.num_prompt_tokens = state.num_prompt_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.state.token_ids[: self.end]

    @property
    def output_ids(self) -> list[int]:
        return self.state.token_ids[self.num_prompt_tokens : self.end]

    @property
    def num_generated(self) -> int:
        return self.end - self.num_prompt_tokens


def accepted_length(samples: list[int], drafts: list[int]) -> int:
    """Tokens a verification emits: the samples up to and including the first that differs from its draft
    (all d + 1 when every draft matches)."""
    for j, d in enumerate(drafts):
        if samples[j] != d:
            return j + 1
    return len(drafts) + 1


def verify(sample: Callable[[torch.Tensor, list[Any]], list[SampleResult]], logits: torch.Tensor,
           requests: list[tuple[RequestState, int]], forced: ForcedAcceptance | None = None
           ) -> list[list[SampleResult]]:
    """Verify drafts. Each request's token_ids end with its d provisional drafts and it owns d + 1 consecutive
    rows of `logits` (row j: the distribution after the first j drafts). Every row is sampled by `sample` (a
    BatchSampler) with the drafts before it as history; a request keeps the samples up to the first that differs
    from its draft (all d + 1 when none does). token_ids end with the kept samples afterwards. `forced`
    (benchmarks) decides how many drafts are kept instead: those drafts, then the sample after them."""
    rows = [_VerifyRow(state, len(state.token_ids) - d + j) for state, d in requests for j in range(d + 1)]
    results = sample(logits, rows)
    out: list[list[SampleResult]] = []
    pos = 0
    for state, d in requests:
        confirmed = len(state.token_ids) - d
        mine = results[pos : pos + d + 1]
        pos += d + 1
        drafts = state.token_ids[confirmed:]
        if forced is None:
            kept = mine[: accepted_length([x.token_id for x in mine], drafts)]
        else:
            a = forced.accepted(d)
            kept = [SampleResult(t) for t in drafts[:a]] + [mine[a]]
        del state.token_ids[confirmed:]
        state.token_ids.extend(x.token_id for x in kept)
        out.append(kept)
    return out
