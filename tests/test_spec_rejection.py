"""Verification is rejection sampling with a one-hot draft: for a known target p and draft x, x is accepted with
probability p(x), a rejection emits p with x removed (renormalised), and so the emitted token is distributed as
p; after an accepted draft the next token follows the next row's p. Empirical frequencies over many
independent requests must match within 5 standard errors (fixed seed, so the test is deterministic)."""
from __future__ import annotations

import math

import pytest
import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.executor.batch_sampler import BatchSampler
from appliance.executor.request_table import RequestState
from appliance.executor.sampler import Sampler
from appliance.executor.speculative_verification import accepted_length, verify

N = 20000  # independent verifications


def _target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from, written out: temperature, then top-k (k largest kept)."""
    z = logits / params.temperature
    if params.top_k > 0:
        kth = z.sort(descending=True).values[params.top_k - 1]
        z = z.masked_fill(z < kth, float("-inf"))
    return torch.softmax(z, dim=-1)


def _run(rows: torch.Tensor, drafts: list[int], params: SamplingParams) -> list[list[int]]:
    states = [RequestState(f"r{i}", [3, 4] + drafts, 2, 1, [0], params) for i in range(N)]
    sampler = BatchSampler(Sampler(seed=1234), torch.device("cpu"), None)
    logits = rows.repeat(N, 1)
    out = verify(sampler, logits, [(s, len(drafts)) for s in states])
    for s, emitted in zip(states, out):
        assert s.token_ids == [3, 4] + [x.token_id for x in emitted]
    return [[x.token_id for x in emitted] for emitted in out]


def _assert_matches(counts: torch.Tensor, p: torch.Tensor, n: int) -> None:
    freq = counts / n
    for f, q in zip(freq.tolist(), p.tolist()):
        sigma = math.sqrt(max(q * (1 - q), 1e-12) / n)
        assert abs(f - q) <= 5 * sigma + 1e-9, (freq.tolist(), p.tolist())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)])
def test_emitted_tokens_follow_the_target(params: SamplingParams) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(2, 6, generator=gen) * 1.5
    p0, p1 = _target(rows[0], params), _target(rows[1], params)
    x = int(p0.argsort()[-2])  # a plausible draft that is not the mode
    emitted = _run(rows, [x], params)
    first = torch.tensor([e[0] for e in emitted])
    _assert_matches(torch.bincount(first, minlength=6).float(), p0, N)
    accepted = sum(len(e) == 2 for e in emitted)
    _assert_matches(torch.tensor([float(accepted)]), p0[x : x + 1], N)  # accepted with probability p(x)
    rejected = [e[0] for e in emitted if len(e) == 1]
    assert x not in rejected  # a rejection never emits the draft: p with x removed
    residual = p0.clone()
    residual[x] = 0
    _assert_matches(torch.bincount(torch.tensor(rejected), minlength=6).float(), residual / residual.sum(),
                    len(rejected))
    second = torch.tensor([e[1] for e in emitted if len(e) == 2])  # after an accepted draft: the next row's p
    _assert_matches(torch.bincount(second, minlength=6).float(), p1, len(second))


def test_greedy_rows_accept_while_the_argmax_agrees() -> None:
    rows = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingParams(temperature=0.0)
    states = [RequestState("a", [9, 1, 0], 1, 0, [0], greedy), RequestState("b", [9, 1, 2], 1, 0, [0], greedy),
              RequestState("c", [9, 2, 0], 1, 0, [0], greedy)]
    sampler = BatchSampler(Sampler(), torch.device("cpu"), None)
    out = verify(sampler, rows.repeat(3, 1), [(s, 2) for s in states])
    assert [[x.token_id for x in e] for e in out] == [[1, 0, 2], [1, 0], [1]]
    assert [s.token_ids for s in states] == [[9, 1, 0, 2], [9, 1, 0], [9, 1]]
    assert accepted_length([1, 0, 2], [1, 0]) == 3 and accepted_length([5], []) == 1


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9)])
def test_a_chain_of_two_drafts_emits_the_targets_joint_distribution(params: SamplingParams) -> None:
    """Chi-square over the joint outcome of a 2-draft verification (first emitted token, then whether the
    second and third follow): every outcome's frequency matches what sampling the target step by step gives."""
    from scipy.stats import chi2

    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(3, 5, generator=gen) * 1.2
    p = [_nucleus(rows[j], params) for j in range(3)]
    x0, x1 = int(p[0].argsort()[-1]), int(p[1].argsort()[-2])  # drafts: a likely one, then a less likely one
    emitted = _run(rows, [x0, x1], params)
    # outcomes: (t0,) for t0 != x0; (x0, t1) for t1 != x1; (x0, x1, t2)
    want: dict[tuple[int, ...], float] = {}
    for t0 in range(5):
        if t0 != x0:
            want[(t0,)] = float(p[0][t0])
    for t1 in range(5):
        if t1 != x1:
            want[(x0, t1)] = float(p[0][x0] * p[1][t1])
    for t2 in range(5):
        want[(x0, x1, t2)] = float(p[0][x0] * p[1][x1] * p[2][t2])
    seen: dict[tuple[int, ...], int] = {}
    for e in emitted:
        seen[tuple(e)] = seen.get(tuple(e), 0) + 1
    assert set(seen) <= set(want)
    cells = [k for k, q in want.items() if q * N >= 5]  # chi-square needs expected counts of at least 5
    rest = N - sum(seen.get(k, 0) for k in cells)
    rest_q = 1.0 - sum(want[k] for k in cells)
    observed = [seen.get(k, 0) for k in cells] + [rest]
    expected = [want[k] * N for k in cells] + [rest_q * N]
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    assert stat < chi2.ppf(0.999, len(cells)), (stat, observed, expected)


def _nucleus(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-p (the smallest set of most likely tokens reaching p), renormalised."""
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p >= 1.0:
        return probs
    order = probs.argsort(descending=True)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    total = 0.0
    for t in order.tolist():
        keep[t] = True
        total += float(probs[t])
        if total >= params.top_p:
            break
    out = probs * keep
    return out / out.sum()
