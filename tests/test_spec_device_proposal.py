"""A speculative step decided and drafted on the device (executor/device_proposal.py): the verdict, the drafter's
catch-up over the whole chunks and the chain are queued before the host reads anything, so a step waits once (the
host path waits for the verdict, then for the drafts at the next step's start); the tokens and every step's drafts
equal the host path's (EAGLE-3, EAGLE and MTP; real and forced acceptance; synchronous and overlapped loops).
GPU part: python -m pytest -q -m gpu tests/test_spec_device_proposal.py
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
    spec_kwargs,
)

from appliance import SamplingParams
from appliance.engine.step import StepResult
from appliance.executor import device_proposal, device_verification, speculative
from appliance.executor.draft_graphs import ChainGraphs, PendingChain
from appliance.executor.model_runner import ModelRunner
from appliance.executor.speculative import LaunchedStep, Speculator
from appliance.executor.verify_graphs import VerifyGraphs

one_thread, drafters, reference = spec_fixtures.one_thread, spec_fixtures.drafters, spec_fixtures.reference
tiny_v3 = spec_fixtures.tiny_v3
OVERLAP = {"enable_overlap_schedule": True}
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


Steps = list[tuple[list[str], dict[str, list[int]]]]  # per step: the paths taken, the drafts held after it


@contextmanager
def host_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Every step on the host path, while the context lasts (patch inside it with the context's own object)."""
    with monkeypatch.context() as m:
        m.setattr(speculative, "proposes_on_device", lambda *_: False)
        yield m


def record_steps(monkeypatch: pytest.MonkeyPatch) -> Steps:
    """Every speculative step's paths taken (`proposes_on_device`'s answers, or "ahead" for a step launched before
    the step in flight was read: verify_ahead.py) and the drafts held after it."""
    steps: Steps = []
    paths: list[str] = []
    decide, complete_step = speculative.proposes_on_device, Speculator.complete_step

    def recorded_decide(*args: Any) -> bool:
        on = decide(*args)
        paths.append("device" if on else "host")
        return on

    def recorded_complete(self: Speculator, step: LaunchedStep) -> StepResult:
        result = complete_step(self, step)
        taken = ["ahead"] if step.after is not None else paths[:]
        steps.append((taken, {rid: list(d) for rid, d in self.drafts.items()}))
        paths.clear()
        return result

    monkeypatch.setattr(speculative, "proposes_on_device", recorded_decide)
    monkeypatch.setattr(Speculator, "complete_step", recorded_complete)
    return steps


def both_paths(monkeypatch: pytest.MonkeyPatch, run: Any) -> tuple[list[Any], Steps, list[Any], Steps]:
    """`run()` (a fresh engine's outputs) on the host path, then as the speculator picks: each run's outputs and
    recorded steps."""
    with host_path(monkeypatch) as m:
        steps = record_steps(m)
        host = run()
        host_steps = list(steps)
    steps = record_steps(monkeypatch)
    return host, host_steps, run(), steps


def record_syncs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The order of the plans the runner is handed, the worker's device launches of a step (verify, catch-up,
    chain) and its host reads of the device (the verdict, a chain's drafts)."""
    log: list[str] = []
    run_step, launch, drafts = VerifyGraphs.run_step, ChainGraphs.launch, PendingChain.drafts
    read, plan = device_verification.read_verdict, ModelRunner.launch

    def recorded_plan(self: ModelRunner, *args: Any) -> Any:
        log.append("plan")
        return plan(self, *args)

    def recorded_run_step(self: VerifyGraphs, *args: Any, **kw: Any) -> Any:
        log.append("launch " + ("verify" if type(self) is VerifyGraphs else "catch-up"))
        return run_step(self, *args, **kw)

    def recorded_launch(self: ChainGraphs, *args: Any) -> Any:
        log.append("launch chain")
        return launch(self, *args)

    def recorded_read(verdict: Any) -> list[list[int]]:
        log.append("read verdict")
        return read(verdict)

    def recorded_drafts(self: PendingChain, *args: Any) -> list[list[int]]:
        log.append("read drafts")
        return drafts(self, *args)

    monkeypatch.setattr(ModelRunner, "launch", recorded_plan)
    monkeypatch.setattr(VerifyGraphs, "run_step", recorded_run_step)
    monkeypatch.setattr(ChainGraphs, "launch", recorded_launch)
    monkeypatch.setattr(PendingChain, "drafts", recorded_drafts)
    monkeypatch.setattr(device_verification, "read_verdict", recorded_read)
    monkeypatch.setattr(device_proposal, "read_verdict", recorded_read)
    return log


def waits_per_step(log: list[str]) -> list[int]:
    """For each verify-graph step (from its verify launch to the next), how often the host waited: a read
    with work launched since the previous read."""
    out: list[int] = []
    launched = False
    for event in log:
        if event == "launch verify":
            out.append(0)
        if event.startswith("launch"):
            launched = True
        elif event.startswith("read") and launched and out:
            out[-1] += 1
            launched = False
    return out


def _drafter(name: str, drafters: dict[str, Path]) -> dict[str, Any]:
    return spec_kwargs(name, drafters["eagle3" if name == "EAGLE3" else "eagle"])


@pytest.mark.parametrize("name", ["EAGLE3", "EAGLE"])
@pytest.mark.parametrize("extra", [{}, {"speculative_enable_synthetic_acceptance": True,
                                        "speculative_synthetic_acceptance_length": 2.6}, OVERLAP])
def test_tokens_and_drafts_equal_the_host_path(tiny_model: Path, drafters: dict[str, Path], reference: list[Any],
                                               monkeypatch: pytest.MonkeyPatch, name: str, extra: dict) -> None:
    """Step by step the same drafts held (so the catch-up's masked rows and the chain placed from the device
    lengths compute what the host-built rows do), the same tokens; most steps took the device path."""
    kw = {**_drafter(name, drafters), **extra}
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 2
    host, host_steps, outs, steps = both_paths(monkeypatch, lambda: generate(make_llm(tiny_model, **kw), params))
    assert [o.token_ids for o in outs] == [h.token_ids for h in host]
    if "speculative_enable_synthetic_acceptance" not in extra:  # forced acceptance keeps wrong drafts
        assert outs[0].token_ids == reference[0].token_ids
    assert [d for _, d in steps] == [d for _, d in host_steps]
    device = sum(p in (["device"], ["ahead"]) for p, _ in steps)
    assert device >= len(steps) // 2 and all(p in ([], ["host"]) for p, _ in host_steps)
    assert any(p == ["ahead"] for p, _ in steps) == (extra == OVERLAP)


@pytest.mark.parametrize("loop", [{}, OVERLAP])
def test_a_device_step_waits_once(tiny_model: Path, drafters: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                  loop: dict) -> None:
    """The device path queues verify, catch-up and chain, then reads the verdict and the drafts together: one
    wait per step, and with overlap after the engine handed over the next plan (it planned while the step ran)
    and after that plan's verify, catch-up and chain were queued behind it (verify_ahead.py). The host path reads
    the verdict between the verify and the catch-up, and the drafts at the next step's start: two."""
    kw = {**_drafter("EAGLE3", drafters), **loop}
    with host_path(monkeypatch) as m:
        log = record_syncs(m)
        generate(make_llm(tiny_model, **kw), GREEDY)
        host = waits_per_step(log)
    log = record_syncs(monkeypatch)
    generate(make_llm(tiny_model, **kw), GREEDY)
    device = waits_per_step(log)
    # the last segment runs on to the end of the run; with overlap the first step is read in the second's segment
    assert len(device) >= 10 and set(device[1 if loop else 0 : -1]) == {1} and device[0] == (0 if loop else 1)
    queue = ["launch verify", "launch catch-up", "launch chain"]
    step = queue + (["plan"] + queue if loop else []) + ["read verdict", "read drafts"]
    first = log.index("launch verify")
    assert log[first : first + len(step)] == step
    assert len(host) >= 10 and set(host[:-1]) == {2}


def test_mtp_equals_the_host_path(tiny_v3: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The MTP layer (fed the target's final hidden states, an MLA cache) holds the host path's drafts too."""
    kw = {"speculative_algorithm": "MTP", "speculative_num_steps": 2}
    params = SamplingParams(temperature=0.0, max_tokens=MTP_NEW, ignore_eos=True)
    host, host_steps, outs, steps = both_paths(monkeypatch,
                                               lambda: generate(make_llm(tiny_v3, **kw), params, MTP_PROMPTS))
    assert [o.token_ids for o in outs] == [h.token_ids for h in host]
    assert [d for _, d in steps] == [d for _, d in host_steps]
    assert any(p == ["device"] for p, _ in steps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("length", [None, 1.0])
def test_gpu_device_path_equals_the_host_path(tiny_model: Path, drafters: dict[str, Path],
                                              monkeypatch: pytest.MonkeyPatch, length: float | None) -> None:
    """Captured verify, catch-up and chain graphs: the device path's tokens are the host path's and the target's
    alone (real acceptance, and every draft rejected), and its drafts the host path's at almost every step (the
    catch-up's padded row count differs between the paths, so a near-tie of the head's logits may break the
    other way)."""
    kw = {**_drafter("EAGLE3", drafters), **OVERLAP}
    if length is not None:
        kw |= {"speculative_enable_synthetic_acceptance": True, "speculative_synthetic_acceptance_length": length}
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)] * 2
    want = [o.token_ids for o in generate(gpu_llm(tiny_model), params)]
    host, host_steps, outs, steps = both_paths(monkeypatch, lambda: generate(gpu_llm(tiny_model, **kw), params))
    assert [o.token_ids for o in outs] == [h.token_ids for h in host] == want
    assert sum(p in (["device"], ["ahead"]) for p, _ in steps) >= len(steps) // 2
    same = sum(d == h for (_, d), (_, h) in zip(steps, host_steps))
    assert same >= 0.9 * min(len(steps), len(host_steps))
