"""Drafts drawn from the drafter's distribution q, and their rejection sampling (Leviathan et al. 2023, Chen et
al. 2023; vLLM's rejection sampler with draft probabilities).

A request that samples at temperature > 0 without a seed gets drafts drawn from the drafter's q (its logits at
the request's temperature and filters, executor/sampler.py filtered_probs); the verification accepts draft x at
row j with probability min(1, p_j(x) / q_j(x)), where p_j is the target's distribution at that row (penalties,
bias, grammar mask and filters included: Sampler.probabilities), and at the first rejection emits a sample of
norm(max(0, p_j - q_j)); after d accepted drafts it emits a sample of p_d. Every emitted token is then
distributed as the target's, and a draft is accepted with probability 1 - TV(p, q) (a greedy draft only with
p(argmax q)), so a drafter close to the target keeps more of its drafts at high temperature.

Greedy and seeded requests draft greedily instead and verify with the one-hot rule (speculative_verification.py):
their tokens then equal the tokens without speculation exactly, whatever the drafts and the batch. N-gram drafts
have no q and always take the one-hot rule.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.executor.batch_sampler import sampling_row
from appliance.executor.request_table import RequestState
from appliance.executor.sampler import _GREEDY_EPS, Sampler, SampleResult, filtered_probs


def draws_drafts(params: SamplingParams) -> bool:
    """Whether a request's drafts are drawn from the drafter's q (random and unseeded) rather than its argmax."""
    return params.temperature >= _GREEDY_EPS and params.seed is None


class DraftPicker:
    """Chooses the tokens of one draft chain from the drafter's logits: argmax for greedy and seeded requests,
    a draw of q for the others, whose q rows it keeps for the verification. `id_map` maps a drafter's own
    vocabulary onto the target's (an EAGLE-3 head's d2t); `vocab` is the target's vocabulary size."""

    def __init__(self, states: Sequence[RequestState], generator: torch.Generator | None,
                 id_map: torch.Tensor | None, vocab: int) -> None:
        self.states, self.generator, self.id_map, self.vocab = states, generator, id_map, vocab
        self.draws = np.asarray([draws_drafts(s.params) for s in states], dtype=bool)
        self._steps: list[tuple[np.ndarray, torch.Tensor]] = []  # (chain rows drawn, their q in the target's vocab)

    def pick(self, logits: torch.Tensor, alive: np.ndarray) -> torch.Tensor:
        """Tokens (target ids) for the rows `alive` (indices into the chain's states) of one draft step."""
        tokens = logits.argmax(dim=-1)
        drawn = np.flatnonzero(self.draws[alive])
        if drawn.size:
            index = torch.from_numpy(drawn).to(logits.device)
            q = filtered_probs(logits.float().index_select(0, index), [self.states[a].params for a in alive[drawn]])
            noise = torch.empty_like(q).exponential_(generator=self.generator)
            tokens = tokens.index_copy(0, index, (q / noise).argmax(dim=-1))
            self._steps.append((alive[drawn], self._widen(q)))
        return tokens if self.id_map is None else self.id_map[tokens]

    def _widen(self, q: torch.Tensor) -> torch.Tensor:
        if self.id_map is None:
            return q
        out = q.new_zeros(q.shape[0], self.vocab)
        out[:, self.id_map] = q
        return out

    def probs(self, state_index: int, num_drafts: int) -> torch.Tensor | None:
        """The q rows [num_drafts, vocab] of a state's drafts (None for a state drafted greedily)."""
        if not self.draws[state_index] or num_drafts == 0:
            return None
        rows = [q[int(np.flatnonzero(at == state_index)[0])] for at, q in self._steps if state_index in at]
        return torch.stack(rows[:num_drafts])


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched rejection sampling of padded chains: target p [n, D + 1, V], draft q [n, D, V], drafts [n, D]
    (drawn from q), num_drafts [n] <= D. Returns (accepted drafts [n], the token emitted after them [n]): a
    sample of norm(max(0, p - q)) at the first rejected row, or of p after the last draft."""
    n, width = drafts.shape
    u = torch.rand(n, width, generator=generator, device=p.device)
    px = p[:, :width].gather(-1, drafts[..., None]).squeeze(-1)
    qx = q.gather(-1, drafts[..., None]).squeeze(-1)
    live = torch.arange(width, device=p.device)[None] < num_drafts[:, None]
    accept = (u * qx < px) & live  # u < p / q; a draft q never drew (qx = 0) cannot reach here
    accepted = accept.to(torch.int64).cumprod(dim=-1).sum(dim=-1)
    rows = torch.arange(n, device=p.device)
    target = p[rows, accepted]
    residual = (target - q[rows, accepted.clamp(max=width - 1)]).clamp(min=0) if width else target
    residual = torch.where((accepted < num_drafts)[:, None], residual, target)
    # p = q on the row leaves no residual, but then the draft was accepted (u < 1): the fallback never emits
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, target)
    noise = torch.empty_like(residual).exponential_(generator=generator)
    return accepted, (residual / noise).argmax(dim=-1)


def verify_drawn(sampler: Sampler, logits: torch.Tensor, requests: list[tuple[RequestState, int, torch.Tensor]],
                 rows: Sequence[object]) -> list[list[SampleResult]]:
    """Verify drafts drawn from q: each request's token_ids end with its d provisional drafts and it owns d + 1
    consecutive rows of `logits` (`rows`: the matching speculative_verification rows, the drafts before each as
    history). token_ids end with the emitted tokens afterwards."""
    probs = sampler.probabilities(logits, [sampling_row(r) for r in rows]).view(-1, logits.shape[-1])
    width = max(d for _, d, _ in requests)
    n, vocab, dev = len(requests), logits.shape[-1], logits.device
    p = probs.new_zeros(n, width + 1, vocab)
    q = probs.new_zeros(n, width, vocab)
    drafts = torch.zeros(n, width, dtype=torch.int64)
    first = 0
    for i, (state, d, draft_q) in enumerate(requests):
        p[i, : d + 1] = probs[first : first + d + 1]
        q[i, :d] = draft_q[:d]
        drafts[i, :d] = torch.tensor(state.token_ids[len(state.token_ids) - d :])
        first += d + 1
    counts = torch.tensor([d for _, d, _ in requests], device=dev)
    accepted, emitted = rejection_sample(p, q, drafts.to(dev), counts, sampler.generator(dev))
    out: list[list[SampleResult]] = []
    first = 0
    for (state, d, _), a, token in zip(requests, accepted.tolist(), emitted.tolist()):
        confirmed = len(state.token_ids) - d
        tokens = state.token_ids[confirmed : confirmed + a] + [token]
        out.append([sampler.result(t, sampling_row(rows[first + j]), logits[first + j])  # type: ignore[arg-type]
                    for j, t in enumerate(tokens)])
        del state.token_ids[confirmed:]
        state.token_ids.extend(tokens)
        first += d + 1
    return out
