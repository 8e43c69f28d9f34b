"""The sampling end of an eager or graph step: which rows of the step's hidden states the LM head scores (each
sampling chunk's last row, the prompt rows of requests that asked for prompt logprobs), sampled on the host now,
or on the device with the ids left in flight (inflight.py) when nothing of the step needs them on the host."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from appliance.engine.step import SampledToken, StepResult
from appliance.executor import inflight, logits_processors
from appliance.executor.inflight import StepHandle
from appliance.executor.input_batch import Chunk
from appliance.executor.sampler import prompt_logprobs

if TYPE_CHECKING:
    from appliance.executor.model_runner import ModelRunner

PromptLogprobs = dict[str, list[list[tuple[int, float]] | None]]


def deferrable(runner: ModelRunner, chunks: list[Chunk]) -> bool:
    """Every sampled row samples on the device, nothing needs the host's token history this step, and no
    multi-token chunk reads a token still in flight."""
    sampling = [c.state for c in chunks if c.sample]
    return (all(not c.wants_prompt_logprobs and (c.num_tokens == 1 or c.start + c.num_tokens <= len(
                c.state.token_ids)) for c in chunks)
            and not any(logits_processors.wants_processors(s.params.extra) for s in sampling)
            and runner.batch_sampler.on_device(sampling))


def sample_deferred(runner: ModelRunner, step_id: int, ordered: list[Chunk], row_starts: list[int],
                    hidden: torch.Tensor, order: dict[str, int] | None) -> StepHandle:
    """Sample every sampling chunk's last row on the device; the ids reach the host when the step finishes."""
    rows = [first + c.num_tokens - 1 for c, first in zip(ordered, row_starts) if c.sample]
    sampling = [c for c in ordered if c.sample]
    if not rows:
        return StepHandle(step_id, StepResult(step_id))
    logits = runner.logits(hidden, rows)
    logits_processors.forget_idle(runner)
    ids = runner.batch_sampler.sample_on_device(logits, [c.state for c in sampling])
    return inflight.defer(step_id, sampling, ids, order)


def sample_now(runner: ModelRunner, chunks: list[Chunk], row_starts: list[int], hidden: torch.Tensor
               ) -> tuple[list[SampledToken], PromptLogprobs]:
    """Score the rows that sample or are scored as prompt; append each sampled token to its request."""
    rows: list[int] = []
    sample_at: list[tuple[Chunk, int]] = []  # chunk, index into rows
    prompt_at: list[tuple[Chunk, int, int]] = []  # chunk, first index into rows, count
    if len(row_starts) == hidden.shape[0] and all(c.sample and c.state.params.prompt_logprobs is None
                                                   for c in chunks):
        # a decode step: one row per chunk, each samples, nothing else is scored
        rows, sample_at = list(range(len(chunks))), [(c, i) for i, c in enumerate(chunks)]
        chunks = []
    for c, first in zip(chunks, row_starts):
        if c.wants_prompt_logprobs:
            # row of position p scores prompt token p + 1
            count = min(c.start + c.num_tokens, c.state.num_prompt_tokens - 1) - c.start
            prompt_at.append((c, len(rows), max(count, 0)))
            rows.extend(range(first, first + max(count, 0)))
        if c.sample:
            sample_at.append((c, len(rows)))
            rows.append(first + c.num_tokens - 1)
    if not rows:
        return [], {}
    logits = runner.logits(hidden, rows)
    prompt_lps = {c.state.request_id: prompt_logprobs(c, logits[i : i + n].float()) for c, i, n in prompt_at}
    return _sample_rows(runner, logits, sample_at), prompt_lps


def _sample_rows(runner: ModelRunner, logits: torch.Tensor, sample_at: list[tuple[Chunk, int]]
                 ) -> list[SampledToken]:
    if not sample_at:
        return []
    at = [i for _, i in sample_at]
    sub = logits if at == list(range(logits.shape[0])) else logits[torch.tensor(at, device=logits.device)]
    # grammar / thinking-budget rows are masked first (executor/logits_processors.py)
    results = logits_processors.sample(runner, sub, [c.state for c, _ in sample_at])
    sampled: list[SampledToken] = []
    for (c, _), r in zip(sample_at, results):
        c.state.token_ids.append(r.token_id)
        sampled.append(SampledToken(c.state.request_id, r.token_id, r.logprob, r.top_logprobs, r.rank, r.error))
    return sampled
