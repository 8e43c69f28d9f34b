"""Rejection sampling of drafts drawn from the drafter's distribution q (speculative_rejection.py): on synthetic
p and q, draft x is accepted with probability min(1, p(x)/q(x)) (so a draft is kept with probability
1 - TV(p, q)), every emitted token is distributed as the target's p (chi-square, fixed seeds: deterministic), and
after an accepted draft the next token follows the next row's p, and logprobs are the target's. The draft picker
draws from q for random unseeded requests only (an EAGLE-3 head in its own vocabulary); end to end, a drafter
equal to the target keeps nearly every drawn draft, and a seeded request reproduces alone, in any batch and
without speculation."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import spec_fixtures
import torch
from conftest import TINY_VOCAB
from scipy.stats import chi2, norm
from spec_fixtures import make_llm, spec_kwargs

from appliance import SamplingParams
from appliance.executor.batch_sampler import BatchSampler
from appliance.executor.request_table import RequestState
from appliance.executor.sampler import Sampler, filtered_probs
from appliance.executor.speculative_rejection import DraftPicker, draws_drafts, rejection_sample
from appliance.executor.speculative_verification import verify

N = 20000
V = 6
one_thread, eagle3_head = spec_fixtures.one_thread, spec_fixtures.eagle3_head


def _chi_square_ok(samples: torch.Tensor, p: torch.Tensor) -> None:
    """Pearson's test at the 0.999 level over the cells with an expected count of at least 5."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=p.numel()).double()
    expected = p.double() * n
    big = expected >= 5
    assert counts[~big].sum() <= max(5.0, 3 * float(expected[~big].sum()) + 5)  # rare cells stay rare
    stat = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    assert stat < chi2.ppf(0.999, int(big.sum()) - 1), (counts.tolist(), expected.tolist())


def _rate_ok(hits: int, n: int, rate: float) -> None:
    sigma = (rate * (1 - rate) / n) ** 0.5
    assert abs(hits / n - rate) <= norm.ppf(0.9995) * sigma + 1e-9, (hits / n, rate)


def _synthetic(seed: int, rows: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=gen) * 1.3, dim=-1)


def test_rejection_sampling_emits_the_targets_distribution() -> None:
    p_rows, q_rows = _synthetic(0, 3), _synthetic(1, 2)
    q_rows[1, 2] = 0.0  # a token q never drafts
    q_rows[1] /= q_rows[1].sum()
    gen = torch.Generator().manual_seed(7)
    drafts = torch.stack([torch.multinomial(q_rows[j], N, replacement=True, generator=gen) for j in range(2)], 1)
    p, q = p_rows.expand(N, 3, V), q_rows.expand(N, 2, V)
    accepted, token = rejection_sample(p, q, drafts, torch.full((N,), 2), torch.Generator().manual_seed(8))
    emitted0 = torch.where(accepted > 0, drafts[:, 0], token)
    _chi_square_ok(emitted0, p_rows[0])  # the first token is the target's
    _rate_ok(int((accepted > 0).sum()), N, float(torch.minimum(p_rows[0], q_rows[0]).sum()))
    kept = accepted > 0  # after an accepted draft, the next token follows the next row
    emitted1 = torch.where(accepted[kept] > 1, drafts[kept, 1], token[kept])
    _chi_square_ok(emitted1, p_rows[1])
    _chi_square_ok(token[accepted == 2], p_rows[2])  # the bonus token after the last draft
    # a rejection never emits the rejected draft where the target wants it less than the drafter
    rejected = accepted == 0
    low = p_rows[0] < q_rows[0]
    assert not low[token[rejected]].logical_and(token[rejected] == drafts[rejected, 0]).any()


def test_rows_with_fewer_drafts_stop_at_their_own_count() -> None:
    p = _synthetic(2, 3)[None].repeat(4, 1, 1)
    q = p[:, :2].clone()  # q = p: every live draft is accepted
    drafts = torch.tensor([[1, 2], [3, 0], [0, 0], [4, 5]])
    accepted, _ = rejection_sample(p, q, drafts, torch.tensor([2, 1, 0, 2]), torch.Generator().manual_seed(0))
    assert accepted.tolist() == [2, 1, 0, 2]


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, top_k=4),
                                    SamplingParams(temperature=1.0, presence_penalty=0.7, min_p=0.05)])
def test_verification_of_drawn_drafts_follows_the_sampler(params: SamplingParams) -> None:
    """Through verify(): p is the sampler's distribution at the row (temperature, filters, penalties over the
    history with the drafts before the row), q the drafter's; the emitted tokens follow p."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(2, V, generator=gen) * 1.5
    q_rows = _synthetic(6, 1)
    drafts = torch.multinomial(q_rows[0], N, replacement=True, generator=gen).tolist()
    states = [RequestState(f"r{i}", [3, 4, x], 2, 1, [0], params) for i, x in enumerate(drafts)]
    sampler = Sampler(seed=3)
    batch = BatchSampler(sampler, torch.device("cpu"), None)
    out = verify(batch, rows.repeat(N, 1), [(s, 1) for s in states], None, [q_rows] * N, sampler)
    p0 = filtered_probs(rows[:1], [params])[0]  # no output yet: penalties change nothing at row 0
    first = torch.tensor([e[0].token_id for e in out])
    _chi_square_ok(first, p0)
    for x in range(V):  # after draft x the history is [x]: the presence penalty applies to it
        history = torch.zeros(1, V)
        history[0, x] = 1.0
        p1 = filtered_probs(rows[1:] - params.presence_penalty * history, [params])[0]
        second = [e[1].token_id for e, d in zip(out, drafts) if len(e) == 2 and d == x]
        if len(second) > 2000:
            _chi_square_ok(torch.tensor(second), p1)
    assert all(s.token_ids == [3, 4] + [x.token_id for x in e] for s, e in zip(states, out))


def test_the_picker_draws_random_unseeded_rows_and_keeps_their_q() -> None:
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_p=0.8),
              SamplingParams(temperature=0.9, seed=4)]
    assert [draws_drafts(p) for p in params] == [False, True, False]
    states = [RequestState(f"r{i}", [1, 2], 2, 1, [0], p) for i, p in enumerate(params)]
    id_map = torch.tensor([5, 0, 3, 1])  # a drafter vocabulary of 4 ids inside the target's 6
    picker = DraftPicker(states, torch.Generator().manual_seed(1), id_map, V)
    logits = torch.tensor([[0.1, 2.0, 0.5, 0.3]] * 3)
    first = picker.pick(logits, np.arange(3))
    assert first[0] == 0 and first[2] == 0  # argmax 1 -> target id 0
    second = picker.pick(logits[1:], np.array([1, 2]))
    assert second[1] == 0
    assert picker.probs(0, 1) is None and picker.probs(2, 2) is None
    q = picker.probs(1, 2)
    want = filtered_probs(logits[:1], [params[1]])[0]
    assert q.shape == (2, V) and torch.allclose(q[:, id_map], want.expand(2, 4)) and q[:, [2, 4]].eq(0).all()
    draws = [int(DraftPicker(states[1:2], torch.Generator().manual_seed(s), None, 4).pick(logits[:1], np.arange(1)))
             for s in range(3000)]
    _chi_square_ok(torch.tensor(draws), want)


def test_a_drafter_equal_to_the_target_keeps_its_drawn_drafts(tiny_model: Path) -> None:
    """The target as its own draft model: drawn drafts have q = p, so (nearly) every one is accepted, while
    seeded requests (greedy drafts, one-hot verification) keep only those their own draw agrees with."""
    llm = make_llm(tiny_model, **spec_kwargs("STANDALONE", tiny_model))
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8, 9]} for i in range(4)]

    def rate(params: list[SamplingParams]) -> float:
        before = llm.engine.stats()
        outs = llm.generate(prompts, params)
        after = llm.engine.stats()
        assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
        return ((after.spec_num_accepted_tokens - before.spec_num_accepted_tokens)
                / (after.spec_num_draft_tokens - before.spec_num_draft_tokens))

    drawn = rate([SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)] * 4)
    seeded = rate([SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True) for i in range(4)])
    assert drawn > 0.97 and seeded < drawn
    assert llm.engine.check_accounting().ok


def test_drawn_verification_reports_the_targets_logprobs() -> None:
    params = SamplingParams(temperature=0.9, logprobs=2)
    rows = torch.randn(3, V, generator=torch.Generator().manual_seed(9))
    q = _synthetic(10, 2)
    states = [RequestState(f"r{i}", [1, 2, 3, 4], 2, 1, [0], params) for i in range(50)]
    sampler = Sampler(seed=1)
    out = verify(BatchSampler(sampler, torch.device("cpu"), None), rows.repeat(50, 1), [(s, 2) for s in states],
                 None, [q] * 50, sampler)
    raw = torch.log_softmax(rows, dim=-1)
    for e in out:
        for j, x in enumerate(e):
            assert x.logprob == pytest.approx(float(raw[j, x.token_id]), abs=1e-5)
            assert x.top_logprobs == [(int(t), pytest.approx(float(v), abs=1e-5)) for v, t in zip(*raw[j].topk(2))]
            assert x.rank == int((raw[j] > raw[j, x.token_id]).sum()) + 1
    assert max(len(e) for e in out) > 1  # drafts were kept, so later rows were reported too


def test_eagle3_heads_draw_in_their_own_vocabulary(tiny_model: Path, eagle3_head: Path) -> None:
    """A head with a smaller draft vocabulary (d2t): drawn drafts map to target ids, q is spread over the
    target's vocabulary, and random rows run to completion with the pool whole."""
    llm = make_llm(tiny_model, **spec_kwargs("EAGLE3", eagle3_head))
    spec = llm.executor.runner.spec
    seen: list[torch.Tensor] = []
    original = spec.chain

    def spy(*args: object, **kw: object) -> None:
        original(*args, **kw)
        seen.extend(spec.draft_probs.values())

    spec.chain = spy
    outs = llm.generate([{"prompt_token_ids": [5 + i, 6, 7, 8, 9, 10]} for i in range(3)],
                        SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)
    assert seen and all(q.shape[-1] == TINY_VOCAB and torch.allclose(q.sum(-1), torch.ones(q.shape[0])) for q in seen)
    support = set(head_ids(spec))
    assert all(set(torch.nonzero(q.sum(0)).flatten().tolist()) <= support for q in seen)
    assert llm.engine.stats().spec_num_drafts > 0 and llm.engine.check_accounting().ok


def head_ids(spec: object) -> list[int]:
    return spec.head.target_ids().tolist()  # type: ignore[attr-defined]


def test_a_seeded_request_reproduces_alone_and_in_any_batch(tiny_model: Path) -> None:
    """Seeded rows draft greedily and verify one-hot: their tokens depend on (seed, position) only, so the same
    request gives the same tokens alone, in a batch of drawn-draft neighbours, and without speculation."""
    seeded = SamplingParams(temperature=1.0, top_k=30, seed=123, max_tokens=20, ignore_eos=True)
    prompt = {"prompt_token_ids": [9, 8, 7, 6, 5]}
    llm = make_llm(tiny_model, **spec_kwargs("STANDALONE", tiny_model))
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [20 + i, 21, 22]} for i in range(3)]
    random = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batch = llm.generate(others[:2] + [prompt] + others[2:], [random, random, seeded, random])
    plain = make_llm(tiny_model).generate([prompt], seeded)[0].outputs[0].token_ids
    assert batch[2].outputs[0].token_ids == alone == plain
    assert llm.engine.stats().spec_num_accepted_tokens > 0
