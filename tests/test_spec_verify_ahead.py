"""A verification step launched before the step in flight is read (executor/verify_ahead.py): with overlap, the
outputs equal the synchronous loop's and those of the loop that reads each step first (EAGLE-3, EAGLE and MTP;
real acceptance, forced 2.6 and 1; stop tokens and max_tokens ending mid-verification), the steps launched ahead
hold the drafts the read-first loop holds, and the verdict from device drafts and lengths is the host-built one.
GPU part: python -m pytest -q -m gpu tests/test_spec_device_proposal.py (its overlapped cases take this path)
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import spec_fixtures
import torch
from spec_fixtures import MTP_NEW, MTP_PROMPTS, generate, make_llm, spec_kwargs
from test_spec_device_proposal import record_steps, record_syncs

from appliance import SamplingParams
from appliance.executor import speculative
from appliance.executor.device_verification import (
    VerifyBatch,
    launch_verdict,
    launch_verdict_ahead,
)
from appliance.executor.input_batch import Stager

one_thread, drafters, tiny_v3 = spec_fixtures.one_thread, spec_fixtures.drafters, spec_fixtures.tiny_v3
OVERLAP = {"enable_overlap_schedule": True}
ACCEPTANCE = [{}, {"speculative_enable_synthetic_acceptance": True, "speculative_synthetic_acceptance_length": 2.6},
              {"speculative_enable_synthetic_acceptance": True, "speculative_synthetic_acceptance_length": 1.0}]


def _params(stop: int | None) -> list[SamplingParams]:
    """Lengths that end mid-verification (5, 11, 13 with k = 3: 1 + 3 tokens a step) beside a long one, and a stop
    token on the third request."""
    g = {"temperature": 0.0, "ignore_eos": True}
    return [SamplingParams(max_tokens=32, **g), SamplingParams(max_tokens=5, **g),
            SamplingParams(max_tokens=11, stop_token_ids=[stop] if stop is not None else None, **g),
            SamplingParams(max_tokens=13, **g)]


def _three_loops(monkeypatch: pytest.MonkeyPatch, model: Path, kw: dict[str, Any], prompts: list[list[int]],
                 params: list[SamplingParams]) -> tuple[list[list[int]], list[list[int]], list[list[int]], Any]:
    """Outputs of the synchronous loop, of overlap reading each step first, and of overlap launching ahead (with
    the latter two's recorded steps)."""
    sync = [o.token_ids for o in generate(make_llm(model, **kw), params, prompts)]
    with monkeypatch.context() as m:
        m.setattr(speculative, "launches_ahead", lambda *_: False)
        first_steps = record_steps(m)
        read_first = [o.token_ids for o in generate(make_llm(model, **kw, **OVERLAP), params, prompts)]
        first_steps = list(first_steps)
    steps = record_steps(monkeypatch)
    ahead = [o.token_ids for o in generate(make_llm(model, **kw, **OVERLAP), params, prompts)]
    return sync, read_first, ahead, (first_steps, steps)


def _check(sync: list[list[int]], read_first: list[list[int]], ahead: list[list[int]], steps: Any,
           params: list[SamplingParams], forced: bool) -> None:
    """forced: forced acceptance keeps wrong drafts, so its tokens follow the steps' sizes, which overlap changes
    (engine/speculation.py): there the loops with overlap equal each other."""
    first_steps, ahead_steps = steps
    assert ahead == read_first
    if not forced:
        assert ahead == sync
    assert not any(p == ["ahead"] for p, _ in first_steps)
    assert sum(p == ["ahead"] for p, _ in ahead_steps) >= 2
    # the same drafts held after every step: the device-fed rows compute what the host-fed ones do
    assert [d for _, d in ahead_steps] == [d for _, d in first_steps]
    for out, p in zip(ahead, params):
        stopped = bool(p.stop_token_ids) and p.stop_token_ids[0] in out
        assert len(out) == p.max_tokens or (stopped and out.index(p.stop_token_ids[0]) == len(out) - 1)


@pytest.mark.parametrize("name", ["EAGLE3", "EAGLE"])
@pytest.mark.parametrize("acceptance", ACCEPTANCE)
def test_outputs_equal_the_synchronous_loop(tiny_model: Path, drafters: dict[str, Path],
                                            monkeypatch: pytest.MonkeyPatch, name: str, acceptance: dict) -> None:
    """Stops and lengths mid-verification included: a request the step in flight finishes verified once more on
    the device, and the engine dropped those tokens."""
    kw = {**spec_kwargs(name, drafters["eagle3" if name == "EAGLE3" else "eagle"]), **acceptance}
    prompts = spec_fixtures.PROMPTS
    plain = [o.token_ids for o in generate(make_llm(tiny_model, **kw), _params(None), prompts)]
    stop = plain[2][6]  # a token the third request meets mid-run
    params = _params(stop)
    sync, read_first, ahead, steps = _three_loops(monkeypatch, tiny_model, kw, prompts, params)
    assert stop in sync[2] and len(sync[2]) < 11
    _check(sync, read_first, ahead, steps, params, bool(acceptance))


@pytest.mark.parametrize("acceptance", ACCEPTANCE[:2])
def test_mtp_outputs_equal_the_synchronous_loop(tiny_v3: Path, monkeypatch: pytest.MonkeyPatch,
                                                acceptance: dict) -> None:
    """The MTP layer (fed the target's final hidden states, an MLA cache)."""
    kw = {"speculative_algorithm": "MTP", "speculative_num_steps": 3, **acceptance}
    g = {"temperature": 0.0, "ignore_eos": True}
    params = [SamplingParams(max_tokens=3 * MTP_NEW, **g), SamplingParams(max_tokens=7, **g)] * 2
    sync, read_first, ahead, steps = _three_loops(monkeypatch, tiny_v3, kw, MTP_PROMPTS, params)
    _check(sync, read_first, ahead, steps, params, bool(acceptance))


def test_the_next_verify_is_launched_before_the_read(tiny_model: Path, drafters: dict[str, Path],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """In steady state every read of a step's verdict comes after the next plan's verify, catch-up and chain."""
    kw = {**spec_kwargs("EAGLE3", drafters["eagle3"]), **OVERLAP}
    log = record_syncs(monkeypatch)
    generate(make_llm(tiny_model, **kw), SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    reads = [i for i, e in enumerate(log) if e == "read verdict"]
    assert len(reads) >= 5
    for i in reads[:-1]:  # the last step is read with nothing planned after it
        plan = max(j for j in range(i) if log[j] == "plan")
        assert log[plan + 1 : i] == ["launch verify", "launch catch-up", "launch chain"]


def test_verdict_from_device_drafts_equals_the_host_built_one() -> None:
    """launch_verdict_ahead (drafts and starts on the device) against launch_verdict (host-built) on random
    samples, drafts that match a random prefix, held counts 1..K and forced counts."""
    gen = torch.Generator().manual_seed(0)
    k, b, vocab = 3, 5, 50
    held = [1, 3, 2, 3, 1]
    starts = [7, 30, 12, 4, 19]
    rows = [3, 1, 4, 2, 5]
    firsts = np.cumsum([0] + [d + 1 for d in held]).tolist()[:-1]
    samples = torch.randint(0, vocab, (sum(d + 1 for d in held),), generator=gen)
    drafts = torch.randint(0, vocab, (b, k + 1), generator=gen)
    for i, (f, d) in enumerate(zip(firsts, held)):  # a random matching prefix
        keep = int(torch.randint(0, d + 1, (1,), generator=gen))
        drafts[i, :keep] = samples[f : f + keep]
    for forced in (None, [2, 0, 3, 1, 1]):
        host_lens, dev_lens = torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64)
        batch = VerifyBatch(firsts, [drafts[i, :d].tolist() for i, d in enumerate(held)], rows, starts, forced)
        want = launch_verdict(samples, batch, k, Stager(torch.device("cpu")), host_lens)
        dev_lens[rows] = torch.tensor([s + d + 1 for s, d in zip(starts, held)])  # where the verify graph left them
        got = launch_verdict_ahead(samples, firsts, held, rows, drafts, forced, k, Stager(torch.device("cpu")),
                                   dev_lens)
        assert torch.equal(got.counts, want.counts) and torch.equal(got.tokens, want.tokens)
        assert torch.equal(dev_lens, host_lens)
        assert want.counts.min() >= 1 and (want.counts > 1).any()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("acceptance", ACCEPTANCE)
def test_gpu_outputs_equal_the_read_first_loop(tiny_model: Path, drafters: dict[str, Path],
                                               monkeypatch: pytest.MonkeyPatch, acceptance: dict) -> None:
    """Captured graphs, pinned copies read a step late: launching ahead gives the read-first loop's tokens (the
    same graphs at the same shapes) and, with real acceptance, the target's own greedy tokens."""
    kw = {**spec_kwargs("EAGLE3", drafters["eagle3"]), **acceptance, **OVERLAP}
    params = _params(None)
    want = [o.token_ids for o in generate(spec_fixtures.gpu_llm(tiny_model), params)]
    with monkeypatch.context() as m:
        m.setattr(speculative, "launches_ahead", lambda *_: False)
        read_first = [o.token_ids for o in generate(spec_fixtures.gpu_llm(tiny_model, **kw), params)]
    steps = record_steps(monkeypatch)
    ahead = [o.token_ids for o in generate(spec_fixtures.gpu_llm(tiny_model, **kw), params)]
    assert ahead == read_first
    if not acceptance:
        assert ahead == want
    assert sum(p == ["ahead"] for p, _ in steps) >= 2
