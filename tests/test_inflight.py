"""Steps in flight (executor/inflight.py) at the ModelRunner level: a step whose rows all sample on the device
returns before its ids reach the host, the next step reads its input ids from the device, and the tokens equal
those of running every step to completion; a step that needs the host's token history finishes the steps in
flight first."""
from __future__ import annotations

import pytest

from appliance.config import build_config
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.step import NewRequestData, ScheduledRequest, StepPlan
from appliance.executor.model_runner import ModelRunner

BLOCK = 4
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [40, 41, 42], "c": [11, 12, 13, 14, 15, 16, 17]}
STEPS = 6


def _runner(path) -> ModelRunner:
    return ModelRunner(build_config(flat=dict(model=str(path), dtype="float32", block_size=BLOCK,
                                              max_total_tokens=256), env={}))


def _new(rid: str, params: SamplingParams, first_block: int) -> NewRequestData:
    prompt = PROMPTS[rid]
    blocks = list(range(first_block, first_block + 8))  # room for prompt + STEPS tokens
    return NewRequestData(rid, prompt, len(prompt), 0, blocks, params.to_dict())


def _plans(params: dict[str, SamplingParams]) -> list[StepPlan]:
    """Step 0 prefills every prompt; steps 1.. decode one token each (the worker appends the samples itself)."""
    news = [_new(rid, params[rid], 8 * i) for i, rid in enumerate(PROMPTS)]
    plans = [StepPlan(0, news, [ScheduledRequest(r, len(p), [], True) for r, p in PROMPTS.items()])]
    for step in range(1, STEPS):
        plans.append(StepPlan(step, [], [ScheduledRequest(r, 1, [], True) for r in PROMPTS]))
    return plans


def _tokens(results) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for res in results:
        for t in res.sampled:
            out[t.request_id].append(t.token_id)
    return out


GREEDY = SamplingParams(temperature=0.0)


def _synchronous(path, params: dict[str, SamplingParams]) -> dict[str, list[int]]:
    runner = _runner(path)
    return _tokens([runner.execute(p) for p in _plans(params)])


def test_launch_ahead_gives_the_synchronous_tokens(tiny_model):
    params = {rid: GREEDY for rid in PROMPTS}
    sync = _synchronous(tiny_model, params)
    runner = _runner(tiny_model)
    handles, results = [], []
    for plan in _plans(params):
        handles.append(runner.launch(plan))  # step N+1 is launched before step N is finished
        if len(handles) == 2:
            assert not handles[0].done and not handles[1].done
            results.append(runner.finish(handles.pop(0)))
    results += [runner.finish(h) for h in handles]
    assert [r.step_id for r in results] == list(range(STEPS))
    assert _tokens(results) == sync
    assert all(len(v) == STEPS for v in sync.values())
    state = runner.requests["a"]
    assert state.num_pending == 0 and state.pending_at is None
    assert state.token_ids == PROMPTS["a"] + sync["a"]


def test_a_step_needing_host_history_finishes_the_steps_in_flight(tiny_model):
    # "c" has a repetition penalty: the torch Sampler reads its output ids, so its steps cannot be deferred
    params = {"a": GREEDY, "b": GREEDY, "c": SamplingParams(temperature=0.0, repetition_penalty=1.3)}
    sync = _synchronous(tiny_model, params)
    runner = _runner(tiny_model)
    plans = _plans(params)
    first = runner.launch(plans[0])
    assert first.done  # not deferrable: ran to completion
    results = [runner.finish(first)]
    # the same step without "c" defers; the next one with "c" must complete it first
    only_ab = StepPlan(1, [], [s for s in plans[1].scheduled if s.request_id != "c"])
    h1 = runner.launch(only_ab)
    assert not h1.done
    h2 = runner.launch(StepPlan(2, [], [ScheduledRequest(r, 1, [], True) for r in ("a", "b", "c")]))
    assert h1.done and h2.done
    results += [runner.finish(h1), runner.finish(h2)]
    got = _tokens(results)
    assert got["a"] == sync["a"][:3] and got["b"] == sync["b"][:3] and got["c"] == sync["c"][:2]


def test_resolving_a_token_that_is_neither_known_nor_in_flight_is_an_error(tiny_model):
    runner = _runner(tiny_model)
    plans = _plans({rid: GREEDY for rid in PROMPTS})
    runner.finish(runner.launch(plans[0]))
    with pytest.raises(ValueError, match="cannot compute"):
        runner.launch(StepPlan(1, [], [ScheduledRequest("a", 2, [], True)]))
