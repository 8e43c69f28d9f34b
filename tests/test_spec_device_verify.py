"""Verification on the device (executor/device_verification.py): the accept decision of random samples and drafts
equals the host rule (speculative_verification.accepted_length) with columns past the held count masked, forced
acceptance keeps the forced drafts, the device lengths become the confirmed ends; through the offline LLM the
device path is taken for greedy rows and gives the tokens of the host verifier and of the target alone (EAGLE-3,
a standalone draft model, MTP; synchronous and overlapped loops; acceptance forced at 1 and at a high value;
stops and max_tokens inside a chunk; requests arriving and finishing between steps), and seeded sampled
requests reproduce. GPU part: python -m pytest -q -m gpu tests/test_spec_device_verify.py
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import spec_fixtures
import torch
from spec_fixtures import (
    MTP_NEW,
    MTP_PROMPTS,
    NEW,
    generate,
    gpu_llm,
    make_llm,
    oracle,
    spec_kwargs,
)

from appliance import SamplingParams
from appliance.executor import device_proposal, speculative_scoring
from appliance.executor.device_verification import VerifyBatch, accept, decide
from appliance.executor.input_batch import Stager
from appliance.executor.speculative import Speculator
from appliance.executor.speculative_verification import accepted_length

one_thread, drafters, reference = spec_fixtures.one_thread, spec_fixtures.drafters, spec_fixtures.reference
tiny_v3, mtp_reference = spec_fixtures.tiny_v3, spec_fixtures.mtp_reference
OVERLAP = {"enable_overlap_schedule": True}


def _random_batch(gen: torch.Generator, b: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Samples over a vocabulary of 3 (so runs of matches are common), drafts equal to the samples with
    probability 0.7 per column, held counts 0..k."""
    samples = torch.randint(0, 3, (b, k + 1), generator=gen)
    other = torch.randint(0, 3, (b, k), generator=gen)
    drafts = torch.where(torch.rand(b, k, generator=gen) < 0.7, samples[:, :k], other)
    held = torch.randint(0, k + 1, (b,), generator=gen)
    return samples, drafts, held


@pytest.mark.parametrize("k", [1, 3, 5])
def test_accept_is_the_host_rule_with_masked_columns(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    samples, drafts, held = _random_batch(gen, 64, k)
    drafts_seen = drafts.clone()
    for i in range(64):  # what lies past the held count must not matter
        drafts_seen[i, int(held[i]):] = samples[i, int(held[i]):k]
    v = accept(samples, drafts_seen, held)
    counts = v.counts.tolist()
    assert len(set(counts)) > 1  # the random batch has both short and long runs
    for i in range(64):
        d = int(held[i])
        want = accepted_length(samples[i, : d + 1].tolist(), drafts_seen[i, :d].tolist())
        assert counts[i] == want
        assert v.tokens[i, :want].tolist() == samples[i, :want].tolist()


def test_forced_acceptance_keeps_the_forced_drafts() -> None:
    gen = torch.Generator().manual_seed(3)
    samples, drafts, held = _random_batch(gen, 32, 3)
    forced = torch.randint(0, 4, (32,), generator=gen)
    v = accept(samples, drafts, held, forced)
    for i in range(32):
        a = min(int(forced[i]), int(held[i]))
        assert int(v.counts[i]) == a + 1
        assert v.tokens[i, : a + 1].tolist() == drafts[i, :a].tolist() + [int(samples[i, a])]


def test_accept_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="one batch"):
        accept(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64),
               torch.zeros(2, dtype=torch.int64))


def test_decide_reads_flat_rows_and_sets_the_confirmed_lengths() -> None:
    # request a: 2 drafts [4, 9] at rows 0..2, samples 4, 9, 7 (all accepted, bonus 7);
    # request b: 1 draft [5] at rows 3..4, samples 6, 8 (rejected at once: emits 6); request c: no drafts held
    samples = torch.tensor([4, 9, 7, 6, 8, 2])
    lens = torch.full((8,), 99, dtype=torch.int64)
    batch = VerifyBatch([0, 3, 5], [[4, 9], [5], []], [2, 5, 6], [10, 20, 30])
    assert decide(samples, batch, 3, Stager(torch.device("cpu")), lens) == [[4, 9, 7], [6], [2]]
    assert lens.tolist() == [99, 99, 13, 99, 99, 21, 31, 99]
    forced = VerifyBatch([0, 3, 5], [[4, 9], [5], []], [2, 5, 6], [10, 20, 30], forced=[0, 1, 3])
    assert decide(samples, forced, 3, Stager(torch.device("cpu")), None) == [[4], [5, 8], [2]]
    with pytest.raises(ValueError, match="num_steps"):
        decide(samples, VerifyBatch([0], [[1, 2, 3, 4]], [1], [0]), 3, Stager(torch.device("cpu")), None)


def _count_device_decisions(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The temperature of every verification decided on the device, one entry each."""
    calls: list[float] = []

    def counted(real: Any) -> Any:
        def call(sampler: Any, rows: Any, verifications: list[tuple[Any, int]], *rest: Any) -> Any:
            calls.extend(c.state.params.temperature for c, _ in verifications)
            return real(sampler, rows, verifications, *rest)
        return call

    monkeypatch.setattr(speculative_scoring, "verify_on_device", counted(speculative_scoring.verify_on_device))
    # steps whose catch-up and chain also run on the device (device_proposal.py)
    monkeypatch.setattr(device_proposal, "verdict_on_device", counted(device_proposal.verdict_on_device))
    return calls


def _host_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Speculator, "_decided_on_device", lambda self, state, d: False)


def _setup(name: str, tiny_model: Path, drafters: dict[str, Path]) -> dict[str, Any]:
    return spec_kwargs(*{"EAGLE3": ("EAGLE3", drafters["eagle3"]), "STANDALONE": ("STANDALONE", drafters["draft"]),
                         "EAGLE": ("EAGLE", drafters["eagle"])}[name])


@pytest.mark.parametrize("name", ["EAGLE3", "STANDALONE", "EAGLE"])
@pytest.mark.parametrize("loop", [{}, OVERLAP])
def test_greedy_rows_are_decided_on_the_device(tiny_model: Path, drafters: dict[str, Path], reference: list[Any],
                                               monkeypatch: pytest.MonkeyPatch, name: str, loop: dict) -> None:
    calls = _count_device_decisions(monkeypatch)
    llm = make_llm(tiny_model, **_setup(name, tiny_model, drafters), **loop)
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in reference]
    assert calls and llm.engine.stats().spec_num_drafts > 0
    assert llm.engine.stats().blocks_owned == 0 and llm.engine.check_accounting().ok


@pytest.mark.parametrize("length", [1.0, 3.6])
@pytest.mark.parametrize("loop", [{}, OVERLAP])
def test_forced_acceptance_equals_the_host_verifier(tiny_model: Path, drafters: dict[str, Path],
                                                    monkeypatch: pytest.MonkeyPatch, length: float, loop: dict) -> None:
    """Forced acceptance (benchmarks) draws the same counts in the same order on either path, so the outputs
    (which keep wrong drafts: they are not the target's) are the same; at 1 every draft is rejected."""
    kw = {**_setup("EAGLE3", tiny_model, drafters), "speculative_enable_synthetic_acceptance": True,
          "speculative_synthetic_acceptance_length": length, **loop}
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 2
    with monkeypatch.context() as m:
        _host_only(m)
        host = generate(make_llm(tiny_model, **kw), params)
    calls = _count_device_decisions(monkeypatch)
    llm = make_llm(tiny_model, **kw)
    outs = generate(llm, params)
    assert calls and [o.token_ids for o in outs] == [h.token_ids for h in host]
    stats = llm.engine.stats()
    if length == 1.0:
        assert stats.spec_num_accepted_tokens == 0
    else:
        assert stats.spec_num_accepted_tokens > stats.spec_num_drafts  # more than one per verification
    assert [len(o.token_ids) for o in outs] == [NEW, 5, NEW, 5]


@pytest.mark.parametrize("loop", [{}, OVERLAP])
def test_stops_and_arrivals_between_steps(tiny_model: Path, reference: list[Any], monkeypatch: pytest.MonkeyPatch,
                                          loop: dict) -> None:
    """The target as its own draft model accepts every draft, so stops and max_tokens fall inside a verified
    chunk; requests are added while others decode and finish."""
    calls = _count_device_decisions(monkeypatch)
    refs = [r.token_ids for r in reference]
    prompts = spec_fixtures.PROMPTS
    llm = make_llm(tiny_model, **spec_kwargs("STANDALONE", tiny_model), **loop)
    engine = llm.engine
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[refs[0][6]]),
              SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, stop_token_ids=[refs[2][9]]),
              SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)]
    got: dict[str, list[int]] = {}
    pending = list(range(len(prompts)))
    while pending or engine.has_work():
        if pending:  # one arrival per step
            i = pending.pop(0)
            engine.add_request(str(i), prompts[i], params[i])
        for delta in engine.step():
            got.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    for i, want in enumerate([refs[0][: refs[0].index(refs[0][6]) + 1], refs[1][:5],
                              refs[2][: refs[2].index(refs[2][9]) + 1], refs[3][:7]]):
        assert got[str(i)] == want
    assert calls and engine.stats().blocks_owned == 0 and engine.check_accounting().ok


@pytest.mark.parametrize("loop", [{}, OVERLAP])
def test_seeded_and_random_rows_reproduce(tiny_model: Path, drafters: dict[str, Path], loop: dict) -> None:
    """Seeded rows take the host verifier beside greedy rows decided on the device in the same step; a seed
    gives the same tokens with and without speculation."""
    params = [SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=NEW, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
              SamplingParams(temperature=1.0, top_p=0.9, seed=9, max_tokens=NEW, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)]
    base = generate(make_llm(tiny_model), params)
    outs = generate(make_llm(tiny_model, **_setup("EAGLE3", tiny_model, drafters), **loop), params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]


@pytest.mark.parametrize("loop", [{}, OVERLAP])
def test_device_sampler_rows_emit_what_they_emit_without_drafts(tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
                                                               loop: dict) -> None:
    """Random unseeded rows with one-hot (n-gram) drafts, sampled by the counter-keyed `sample` op (its torch
    reference stands in for the Triton one on the CPU) and decided on the device: every emitted token is the
    target's own sample, keyed on the request's generated count, so the tokens equal plain decoding's."""
    from appliance.kernels import registry

    def with_device_sampler(llm: Any) -> Any:
        llm.executor.runner.batch_sampler.gpu_op = registry.get("sample", "torch")
        return llm

    params = [SamplingParams(temperature=0.9, top_k=30, max_tokens=NEW, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, max_tokens=NEW, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True),
              SamplingParams(temperature=1.0, min_p=0.05, max_tokens=NEW, ignore_eos=True)]
    base = generate(with_device_sampler(make_llm(tiny_model)), params)
    calls = _count_device_decisions(monkeypatch)
    llm = with_device_sampler(make_llm(tiny_model, **spec_kwargs("NGRAM", None), **loop))
    outs = generate(llm, params)
    assert [o.token_ids for o in outs] == [b.token_ids for b in base]
    assert max(calls) > 0 and llm.engine.stats().spec_num_drafts > 0  # random rows were decided on the device
    assert len({tuple(o.token_ids) for o in base}) == len(base)


@pytest.mark.parametrize("wrong", [4, 10**9])
def test_mtp_decided_on_the_device(tiny_v3: Path, mtp_reference: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
                                   wrong: int) -> None:
    refs = mtp_reference["tokens"]
    oracle(monkeypatch, refs, wrong)
    calls = _count_device_decisions(monkeypatch)
    llm = make_llm(tiny_v3, speculative_algorithm="MTP", speculative_num_steps=2, **OVERLAP)
    outs = generate(llm, SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True), MTP_PROMPTS)
    assert [o.token_ids for o in outs] == [refs[tuple(p)][:MTP_NEW] for p in MTP_PROMPTS]
    assert calls and llm.engine.stats().spec_num_accepted_tokens > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("loop", [{}, OVERLAP])
def test_gpu_device_verification_matches_the_host_verifier(tiny_model: Path, drafters: dict[str, Path],
                                                           monkeypatch: pytest.MonkeyPatch, loop: dict) -> None:
    """On a GPU, with the verify, catch-up and draft graphs: greedy rows decided on the device give the host
    verifier's tokens, with real drafts and with a forced acceptance of 1 and of 3.6; unseeded random rows with
    n-gram drafts (the Triton sampler, its noise keyed on each request's generated count) give what they give
    without speculation."""
    torch.backends.cuda.matmul.allow_tf32 = False
    kw = {**_setup("EAGLE3", tiny_model, drafters), **loop}
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    for extra in ({}, {"speculative_enable_synthetic_acceptance": True, "speculative_synthetic_acceptance_length": 1.0},
                  {"speculative_enable_synthetic_acceptance": True, "speculative_synthetic_acceptance_length": 3.6}):
        with monkeypatch.context() as m:
            _host_only(m)
            host = generate(gpu_llm(tiny_model, **kw, **extra), greedy)
        with monkeypatch.context() as m:
            calls = _count_device_decisions(m)
            outs = generate(gpu_llm(tiny_model, **kw, **extra), greedy)
        assert calls and [o.token_ids for o in outs] == [h.token_ids for h in host]
    # one-hot drafts (n-gram) of random unseeded rows: the Triton sampler's rows, decided on the device
    sampled = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=NEW, ignore_eos=True)
    base = generate(gpu_llm(tiny_model), sampled)
    calls = _count_device_decisions(monkeypatch)
    outs = generate(gpu_llm(tiny_model, **spec_kwargs("NGRAM", None), **loop), sampled)
    assert calls and max(calls) > 0 and [o.token_ids for o in outs] == [b.token_ids for b in base]


def test_device_verification_layout_is_fixed() -> None:
    """The upload's shapes depend on the batch and num_steps only, not on the drafts held."""
    stager = Stager(torch.device("cpu"))
    a = VerifyBatch([0, 2], [[1], []], [1, 2], [0, 0]).upload(3, stager)
    b = VerifyBatch([0, 4], [[1, 2, 3], [4]], [1, 2], [0, 0]).upload(3, stager)

    def shapes(u: Any) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in (u.index, u.drafts, u.held, u.table_rows, u.starts)]

    assert shapes(a) == shapes(b) == [(2, 4), (2, 3), (2,), (2,), (2,)] and a.forced is None
    assert a.index.tolist() == [[0, 1, 1, 1], [2, 2, 2, 2]]  # columns past the bonus row repeat it
    assert np.array_equal(b.drafts.numpy(), [[1, 2, 3], [4, 0, 0]]) and b.held.tolist() == [3, 1]
