"""Verification of drafts: a request's d drafts are scored by d + 1 target rows, each sampled with the drafts
before it as history, and the longest matching prefix is kept plus the first sample that differs (the rejection
sampling of a one-hot draft; speculative.py's top explains why every emitted token is the target's). Drafts drawn
from the drafter's distribution are verified against it instead (speculative_rejection.py)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from appliance.executor.request_table import RequestState
from appliance.executor.sampler import Sampler, SampleResult
from appliance.executor.speculative_forced import ForcedAcceptance
from appliance.executor.speculative_rejection import verify_drawn


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


def verification_rows(state: RequestState, d: int) -> list[_VerifyRow]:
    """The d + 1 rows of a verification as the sampler sees them; state.token_ids ends with its d drafts."""
    return [_VerifyRow(state, len(state.token_ids) - d + j) for j in range(d + 1)]


def accepted_length(samples: list[int], drafts: list[int]) -> int:
    """Tokens a verification emits: the samples up to and including the first that differs from its draft
    (all d + 1 when every draft matches)."""
    for j, d in enumerate(drafts):
        if samples[j] != d:
            return j + 1
    return len(drafts) + 1


def verify(sample: Callable[[torch.Tensor, list[Any]], list[SampleResult]], logits: torch.Tensor,
           requests: list[tuple[RequestState, int]], forced: ForcedAcceptance | None = None,
           draft_probs: Sequence[torch.Tensor | None] = (), sampler: Sampler | None = None
           ) -> list[list[SampleResult]]:
    """Verify drafts. Each request's token_ids end with its d provisional drafts and it owns d + 1 consecutive
    rows of `logits` (row j: the distribution after the first j drafts). A request with `draft_probs` (its
    drafts' q rows, drawn from them) is verified by rejection sampling against the target's distribution with
    `sampler` (speculative_rejection.py); the others (one-hot drafts) sample every row with `sample` (a
    BatchSampler) with the drafts before it as history and keep the samples up to the first that differs from
    its draft (all d + 1 when none does). token_ids end with the kept tokens afterwards. `forced` (benchmarks)
    decides how many drafts are kept instead: those drafts, then the sample after them."""
    rows = [_VerifyRow(state, len(state.token_ids) - d + j) for state, d in requests for j in range(d + 1)]
    starts = np.cumsum([0] + [d + 1 for _, d in requests]).tolist()
    probs = list(draft_probs) if forced is None and any(q is not None for q in draft_probs) else []
    drawn = [i for i, q in enumerate(probs) if q is not None]
    one_hot = sorted(set(range(len(requests))) - set(drawn))
    out: list[list[SampleResult]] = [[] for _ in requests]
    if drawn:
        assert sampler is not None
        at = [j for i in drawn for j in range(starts[i], starts[i + 1])]
        index = torch.tensor(at, dtype=torch.int64, device=logits.device)
        kept = verify_drawn(sampler, logits[index], [(requests[i][0], requests[i][1], probs[i]) for i in drawn],
                            [rows[j] for j in at])
        for i, k in zip(drawn, kept):
            out[i] = k
    if not one_hot:
        return out
    at = [j for i in one_hot for j in range(starts[i], starts[i + 1])]
    if len(at) < len(rows):
        logits = logits[torch.tensor(at, dtype=torch.int64, device=logits.device)]
    results = sample(logits, [rows[j] for j in at])
    pos = 0
    for i in one_hot:
        state, d = requests[i]
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
        out[i] = kept
    return out
