"""Sampler: every filter against a plain per-row reference on random logits, penalties, min_tokens, seeds."""
from __future__ import annotations

import math

import pytest
import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.executor.sampler import (
    Sampler,
    SamplingRow,
    apply_min_p,
    apply_penalties,
    apply_top_k,
    apply_top_n_sigma,
    apply_top_p,
)

NEG = float("-inf")


def _logits(rows: int = 6, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ---- plain references: one row at a time, Python lists -------------------------------------------------------
def ref_top_k(row: list[float], k: int) -> list[float]:
    if k <= 0:
        return row
    kth = sorted(row, reverse=True)[min(k, len(row)) - 1]
    return [x if x >= kth else NEG for x in row]


def ref_top_p(row: list[float], p: float) -> list[float]:
    m = max(row)
    exps = [math.exp(x - m) for x in row]
    total = sum(exps)
    order = sorted(range(len(row)), key=lambda i: -row[i])
    keep, mass = set(), 0.0
    for i in order:  # take the most likely tokens until their mass reaches p
        keep.add(i)
        mass += exps[i] / total
        if mass >= p:
            break
    return [x if i in keep else NEG for i, x in enumerate(row)]


def ref_min_p(row: list[float], min_p: float) -> list[float]:
    m = max(row)
    probs = [math.exp(x - m) for x in row]
    top = max(probs)
    return [x if pr >= min_p * top else NEG for x, pr in zip(row, probs)]


def ref_top_n_sigma(row: list[float], n: float) -> list[float]:
    if n <= 0:
        return row
    finite = [x for x in row if x != NEG]
    mean = sum(finite) / len(finite)
    std = math.sqrt(sum((x - mean) ** 2 for x in finite) / (len(finite) - 1))
    return [x if x >= max(finite) - n * std else NEG for x in row]


def ref_penalties(row: list[float], prompt: list[int], output: list[int], rep: float, pres: float,
                  freq: float) -> list[float]:
    out = list(row)
    for t in set(prompt) | set(output):
        out[t] = out[t] / rep if out[t] > 0 else out[t] * rep
    for t in set(output):
        out[t] -= freq * output.count(t) + pres
    return out


def _check(got: torch.Tensor, want: list[list[float]]) -> None:
    for g, w in zip(got.tolist(), want):
        assert [x == NEG for x in g] == [x == NEG for x in w]
        assert [x for x in g if x != NEG] == pytest.approx([x for x in w if x != NEG], abs=1e-5)


def test_top_k_matches_reference():
    logits = _logits()
    ks = torch.tensor([1, 3, 10, 0, -1, 100])
    _check(apply_top_k(logits, ks), [ref_top_k(r, int(k)) for r, k in zip(logits.tolist(), ks)])
    assert (apply_top_k(logits, ks)[0] > NEG).sum() == 1


def test_top_p_matches_reference():
    logits = _logits()
    ps = torch.tensor([0.05, 0.3, 0.5, 0.9, 0.99, 1.0])
    _check(apply_top_p(logits, ps), [ref_top_p(r, float(p)) for r, p in zip(logits.tolist(), ps)])


def test_min_p_matches_reference():
    logits = _logits()
    mps = torch.tensor([0.0, 0.01, 0.1, 0.3, 0.9, 1.0])
    _check(apply_min_p(logits, mps), [ref_min_p(r, float(m)) for r, m in zip(logits.tolist(), mps)])


def test_top_n_sigma_matches_reference():
    logits = _logits()
    logits[2, :10] = NEG  # std over finite logits only
    ns = torch.tensor([0.0, 0.5, 1.0, 2.0, 3.0, 0.1])
    _check(apply_top_n_sigma(logits, ns), [ref_top_n_sigma(r, float(n)) for r, n in zip(logits.tolist(), ns)])


def test_penalties_match_reference():
    logits = _logits(rows=3, vocab=20)
    prompts = [[1, 2, 3], [4, 4], []]
    outputs = [[3, 5, 5, 5], [], [7, 8, 7]]
    rep, pres, freq = [1.3, 0.8, 1.0], [0.5, 0.0, -0.4], [0.2, 1.0, 0.7]
    prompt_mask = torch.zeros(3, 20, dtype=torch.bool)
    counts = torch.zeros(3, 20)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        prompt_mask[i, p] = True
        for t in o:
            counts[i, t] += 1
    got = apply_penalties(logits, prompt_mask, counts, torch.tensor(rep), torch.tensor(pres), torch.tensor(freq))
    want = [ref_penalties(r, p, o, a, b, c) for r, p, o, a, b, c in
            zip(logits.tolist(), prompts, outputs, rep, pres, freq)]
    _check(got, want)


def test_sampler_applies_penalties_before_greedy_argmax():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    plain = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0), [], [])])
    assert plain[0].token_id == 0
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)  # 5/2 < 4: token 0 loses once seen in the prompt
    assert Sampler()(logits, [SamplingRow(rep, [0], [])])[0].token_id == 1
    freq = SamplingParams(temperature=0, frequency_penalty=1.0)  # seen twice in the output: 5 - 2 < 4
    assert Sampler()(logits, [SamplingRow(freq, [], [0, 0])])[0].token_id == 1
    pres = SamplingParams(temperature=0, presence_penalty=0.5)  # 5 - 0.5 > 4: still token 0
    assert Sampler()(logits, [SamplingRow(pres, [], [0, 0])])[0].token_id == 0


def test_logit_bias_moves_the_draw_and_leaves_logprobs_raw():
    logits = _logits(rows=2, vocab=40, seed=3)
    raw = torch.log_softmax(logits, -1)
    low = int(logits[0].argmin())
    biased = SamplingParams(temperature=0, logit_bias=((low, 100.0),), logprobs=1)
    banned = SamplingParams(temperature=0.7, seed=5, logit_bias=[[int(logits[1].argmax()), -100.0]])
    got = Sampler()(logits.clone(), [SamplingRow(biased, [], []), SamplingRow(banned, [], [])])
    assert got[0].token_id == low  # the least likely token wins once +100 is added
    assert got[0].logprob == pytest.approx(raw[0, low].item())  # logprobs are of the raw distribution
    assert got[1].token_id != int(logits[1].argmax())
    # the wire form (lists of pairs) comes back as the same params
    assert SamplingParams.from_dict(banned.to_dict()) == banned


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    logits = torch.tensor([[9.0, 8.0, 7.0, 1.0]])
    sampler = Sampler(eos_token_ids=[0])
    sp = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert sampler(logits.clone(), [SamplingRow(sp, [3], [])])[0].token_id == 2
    assert sampler(logits.clone(), [SamplingRow(sp, [3], [2, 2])])[0].token_id == 0  # min reached
    ignore = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)  # EOS is not a stop then
    assert sampler(logits.clone(), [SamplingRow(ignore, [3], [])])[0].token_id == 0


def test_logprobs_are_raw_with_rank_and_top():
    logits = _logits(rows=1, vocab=30)
    sp = SamplingParams(temperature=0, logprobs=3, repetition_penalty=1.5)
    res = Sampler()(logits, [SamplingRow(sp, [0, 1, 2], [])])[0]
    raw = torch.log_softmax(logits[0], -1)
    assert res.logprob == pytest.approx(raw[res.token_id].item())
    assert res.rank == int((raw > raw[res.token_id]).sum()) + 1
    top = raw.topk(3)
    assert [t for t, _ in res.top_logprobs] == top.indices.tolist()
    assert [v for _, v in res.top_logprobs] == pytest.approx(top.values.tolist())
    assert Sampler()(logits, [SamplingRow(SamplingParams(logprobs=0), [], [])])[0].top_logprobs == []
    assert Sampler()(logits, [SamplingRow(SamplingParams(), [], [])])[0].logprob is None


def test_filters_restrict_what_is_drawn():
    logits = _logits(rows=1, vocab=40, seed=3)
    allowed = set(torch.nonzero(apply_top_k(logits, torch.tensor([4]))[0] > NEG).flatten().tolist())
    sampler = Sampler(seed=1)
    sp = SamplingParams(temperature=1.5, top_k=4)
    drawn = {sampler(logits, [SamplingRow(sp, [], [])])[0].token_id for _ in range(200)}
    assert drawn <= allowed and len(drawn) > 1


def test_draws_follow_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    sampler = Sampler(seed=0)
    rows = [SamplingRow(SamplingParams(temperature=1.0), [], [])] * 4000
    tokens = [r.token_id for r in sampler(logits.expand(4000, 4), rows)]
    freqs = [tokens.count(i) / 4000 for i in range(4)]
    assert freqs == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.03)


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = _logits(rows=5, vocab=64, seed=7)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    other = SamplingParams(temperature=0.8)
    alone = Sampler(seed=0)(logits[2:3], [SamplingRow(seeded, [1], [4, 5])])[0].token_id
    batch_rows = [SamplingRow(other, [], [])] * 2 + [SamplingRow(seeded, [1], [4, 5])] + [SamplingRow(other, [], [])] * 2
    in_batch = Sampler(seed=99)(logits, batch_rows)[2].token_id
    assert alone == in_batch
    # the draw depends on how many tokens were generated, so successive draws differ in general
    draws = {Sampler()(logits[2:3], [SamplingRow(seeded, [1], [0] * n)])[0].token_id for n in range(30)}
    assert len(draws) > 1


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError):
        Sampler()(_logits(rows=2), [SamplingRow(SamplingParams(), [], [])])


def test_a_top_k_beyond_any_vocabulary_keeps_every_token():
    """top_k larger than int64 (the HTTP fuzzer sent 2**63) is stored as TOP_K_ALL, which keeps every token: the
    same draws as top_k disabled, on the torch sampler and in the int32 the GPU sampler takes."""
    from appliance.engine.sampling_params import TOP_K_ALL

    huge = SamplingParams(temperature=1.0, top_k=2**63, seed=5)
    assert huge.top_k == TOP_K_ALL == torch.tensor([huge.top_k], dtype=torch.int32).item()
    off = SamplingParams(temperature=1.0, top_k=0, seed=5)
    logits = _logits(rows=1, vocab=64, seed=3)
    draws = [[Sampler()(logits, [SamplingRow(p, [1], [0] * n)])[0].token_id for n in range(20)] for p in (huge, off)]
    assert draws[0] == draws[1]
    assert torch.equal(apply_top_k(logits, torch.tensor([TOP_K_ALL])), logits)
