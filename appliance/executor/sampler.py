"""Token sampling with vLLM's semantics, batched over rows that each carry their own SamplingParams.

Order per row: logit_bias, penalties (repetition over prompt + output, presence/frequency over output), min_tokens masking
of EOS and stop ids, then greedy argmax (temperature 0) or: temperature, top-n-sigma, min_p, top_k, top_p and a
draw. Logprobs are of the raw model distribution (before penalties and filters), like vLLM's default.
A seeded row draws its noise from a generator derived from (seed, tokens generated so far), so its tokens do
not depend on which other requests share the batch, nor on preemption.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from appliance.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from appliance.executor.input_batch import Chunk

_NEG_INF = float("-inf")
_GREEDY_EPS = 1e-5  # temperatures below this are greedy (dividing by them overflows), as in vLLM


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs about one row: its params, its tokens so far and the model's EOS ids."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]


@dataclass(frozen=True)
class SampleResult:
    token_id: int
    logprob: float | None = None
    rank: int | None = None  # 1 = the most likely token under the raw distribution
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # this row's sampling raised (logits_processors.sample): token_id is a filler


def row_generator(seed: int, num_generated: int) -> torch.Generator:
    """The CPU generator for a seeded request's next draw: a pure function of (seed, tokens generated)."""
    return torch.Generator().manual_seed(hash((seed, num_generated)) & (2**63 - 1))


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    repetition: torch.Tensor, presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
    """Repetition divides positive / multiplies negative logits of seen tokens; presence and frequency subtract."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency[:, None] * output_counts - presence[:, None] * (output_counts > 0).to(logits.dtype)


def apply_top_n_sigma(logits: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Keep logits >= max - n * std (std over the row's finite logits); n <= 0 leaves the row alone."""
    finite = torch.isfinite(logits)
    count = finite.sum(-1, keepdim=True).clamp(min=2)
    vals = torch.where(finite, logits, 0.0)
    mean = vals.sum(-1, keepdim=True) / count
    var = (torch.where(finite, logits - mean, 0.0) ** 2).sum(-1, keepdim=True) / (count - 1)
    threshold = logits.max(-1, keepdim=True).values - n[:, None] * var.sqrt()
    drop = (logits < threshold) & (n[:, None] > 0)
    return logits.masked_fill(drop, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the most likely token's."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.max(-1, keepdim=True).values * min_p[:, None]
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits per row (ties at the k-th value kept); k <= 0 disables."""
    vocab = logits.shape[-1]
    k = torch.where(k <= 0, vocab, k.clamp(max=vocab))
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1).long()[:, None])
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (always at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop_sorted = cum <= (1 - p[:, None])
    drop_sorted[:, -1] = False
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, _NEG_INF)


def filtered_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Probabilities of rows with temperature > 0: temperature, top-n-sigma, min_p, top_k, top_p, softmax (the
    draw's distribution; a drafter's q at the request's settings too)."""
    dev, dtype = logits.device, logits.dtype
    col = lambda name: torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=dev)
    sub = logits / col("temperature")[:, None]
    if any(p.top_n_sigma > 0 for p in params):
        sub = apply_top_n_sigma(sub, col("top_n_sigma"))
    if any(p.min_p > 0 for p in params):
        sub = apply_min_p(sub, col("min_p"))
    if any(p.top_k > 0 for p in params):
        sub = apply_top_k(sub, torch.tensor([p.top_k for p in params], device=dev))
    if any(p.top_p < 1.0 for p in params):
        sub = apply_top_p(sub, col("top_p"))
    return torch.softmax(sub, dim=-1)


class Sampler:
    def __init__(self, eos_token_ids: Sequence[int] = (), seed: int = 0) -> None:
        self.eos_token_ids = tuple(eos_token_ids)
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}  # per device, for rows without a seed

    def generator(self, device: torch.device) -> torch.Generator:
        """The generator of rows without a seed on this device."""
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[SampleResult]:
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} sampling rows")
        logits = logits.float()
        want_logprobs = any(r.params.logprobs is not None for r in rows)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._bias(logits, rows)
        logits = self._penalize(logits, rows)
        logits = self._mask_min_tokens(logits, rows)
        tokens = self._draw(logits, rows)
        return [self._result(i, tokens[i], r, raw_logprobs) for i, r in enumerate(rows)]

    @staticmethod
    def _bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """OpenAI's logit_bias: added to the logits before anything else (ids past the vocabulary are ignored:
        the server refuses them; the padded rows of a model's head are never sampled anyway)."""
        if not any(r.params.logit_bias for r in rows):
            return logits
        logits = logits.clone()  # the caller's logits may be the runner's own tensor
        for i, r in enumerate(rows):
            for token, bias in r.params.logit_bias:
                if token < logits.shape[-1]:
                    logits[i, token] += bias
        return logits

    def _penalize(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        if all(r.params.repetition_penalty == 1.0 and r.params.presence_penalty == 0.0
               and r.params.frequency_penalty == 0.0 for r in rows):
            return logits
        n, vocab = logits.shape
        dev = logits.device
        prompt_mask = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
        counts = torch.zeros(n, vocab, dtype=logits.dtype, device=dev)
        for i, r in enumerate(rows):
            if r.prompt_ids:
                prompt_mask[i, torch.tensor(list(r.prompt_ids), device=dev)] = True
            if r.output_ids:
                out = torch.tensor(list(r.output_ids), device=dev)
                counts[i].index_add_(0, out, torch.ones(len(out), dtype=logits.dtype, device=dev))
        tensor = lambda xs: torch.tensor(xs, dtype=logits.dtype, device=dev)
        return apply_penalties(logits, prompt_mask, counts, tensor([r.params.repetition_penalty for r in rows]),
                               tensor([r.params.presence_penalty for r in rows]),
                               tensor([r.params.frequency_penalty for r in rows]))

    def _mask_min_tokens(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        for i, r in enumerate(rows):
            if len(r.output_ids) < r.params.min_tokens:
                banned = list(r.params.stop_token_ids) + ([] if r.params.ignore_eos else list(self.eos_token_ids))
                banned = [t for t in banned if 0 <= t < logits.shape[-1]]
                if banned:
                    logits[i, banned] = _NEG_INF
        return logits

    def _draw(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> list[int]:
        greedy = [r.params.temperature < _GREEDY_EPS for r in rows]
        tokens = logits.argmax(dim=-1).tolist()
        rand = [i for i, g in enumerate(greedy) if not g]
        if not rand:
            return tokens
        dev = logits.device
        probs = filtered_probs(logits[rand], [rows[i].params for i in rand])
        # Gumbel-style draw: argmax(p / E) with E ~ Exp(1) samples from p; each seeded row has its own noise
        noise = torch.empty(probs.shape, dtype=torch.float32, device=dev).exponential_(generator=self.generator(dev))
        for j, i in enumerate(rand):
            seed = rows[i].params.seed
            if seed is not None:  # drawn on the CPU so a seed means the same tokens on any device
                own = torch.empty(probs.shape[-1], dtype=torch.float32)
                noise[j] = own.exponential_(generator=row_generator(seed, len(rows[i].output_ids))).to(dev)
        drawn = (probs / noise).argmax(dim=-1).tolist()
        for j, i in enumerate(rand):
            tokens[i] = drawn[j]
        return tokens

    def probabilities(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """The distribution each row (temperature > 0) draws its token from: logit_bias, penalties, min_tokens,
        temperature and the filters, as __call__ applies them (speculative_rejection.py verifies against it)."""
        logits = self._mask_min_tokens(self._penalize(self._bias(logits.float(), rows), rows), rows)
        return filtered_probs(logits, [r.params for r in rows])

    def result(self, token: int, row: SamplingRow, logits: torch.Tensor) -> SampleResult:
        """The result for a token chosen elsewhere (a verification): logprobs of the raw logits row."""
        raw = torch.log_softmax(logits.float()[None], dim=-1) if row.params.logprobs is not None else None
        return self._result(0, token, row, raw)

    @staticmethod
    def _result(i: int, token: int, row: SamplingRow, raw: torch.Tensor | None) -> SampleResult:
        k = row.params.logprobs
        if k is None or raw is None:
            return SampleResult(token)
        lp = raw[i]
        chosen = float(lp[token])
        rank = int((lp > lp[token]).sum()) + 1
        top: list[tuple[int, float]] = []
        if k > 0:
            vals, ids = lp.topk(min(k, lp.shape[0]))
            top = list(zip(ids.tolist(), vals.tolist()))
        return SampleResult(token, chosen, rank, top)


def prompt_logprobs(c: Chunk, logits: torch.Tensor) -> list[list[tuple[int, float]] | None]:
    """Entries for the prompt positions this chunk scores: (actual token, logprob) then the top k."""
    out: list[list[tuple[int, float]] | None] = [None] if c.start == 0 else []
    if logits.shape[0] == 0:
        return out
    lps = torch.log_softmax(logits, dim=-1)
    k = c.state.params.prompt_logprobs or 0
    targets = c.state.token_ids[c.start + 1 : c.start + 1 + logits.shape[0]]
    chosen = lps[torch.arange(len(targets)), torch.tensor(targets)].tolist()
    tops = lps.topk(k, dim=-1) if k > 0 else None
    for j, (tok, lp) in enumerate(zip(targets, chosen)):
        entry = [(tok, lp)]
        if tops is not None:
            entry += list(zip(tops.indices[j].tolist(), tops.values[j].tolist()))
        out.append(entry)
    return out
