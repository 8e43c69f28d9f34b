"""Admission that reserves room for output (engine/admission.py, scheduler.schedule_conservativeness).

The ratio's schedule (SGLang's init / decay / min / retraction estimate / idle reset), the reservation arithmetic,
refusals and admissions in the scheduler, conservativeness 0 planning exactly as before, running totals that match
a recount after every step of random workloads (aborts, preemption, overlap), and the point of the feature: the
Llama-3.1-8B benchmark's shape scaled down preempts without the reservation and never with it. (The finish-time
check that follows the sum: test_admission_finish_time.py.)
"""
from __future__ import annotations

import random

import pytest
from engine_workload import (
    PREFIXES,
    assert_each_generates_what_it_generates_alone,
    config_st,
    drive,
    engine_config,
    make_request,
    ops_st,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine import EngineConfig, EngineCore, SamplingParams, admission
from appliance.engine.admission import (
    CLIP_MAX_NEW_TOKENS,
    INIT_NEW_TOKEN_RATIO,
    MIN_NEW_TOKEN_RATIO_FACTOR,
    NEW_TOKEN_RATIO_DECAY_STEPS,
    RETRACT_DECODE_STEPS,
    OutputReservation,
)
from appliance.engine.fake_executor import FakeExecutor, reference_generation
from appliance.engine.request import Request
from appliance.engine.scheduler import Scheduler
from appliance.engine.step import StepPlan


# ---- the ratio -------------------------------------------------------------------------------------------------
def test_sglang_constants() -> None:
    # SGLang's environment defaults: a given --schedule-conservativeness must mean the same in both engines
    assert (INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO_FACTOR, NEW_TOKEN_RATIO_DECAY_STEPS) == (0.7, 0.14, 600)
    assert (RETRACT_DECODE_STEPS, CLIP_MAX_NEW_TOKENS) == (20, 4096)


@pytest.mark.parametrize("c, init", [(1.0, 0.7), (0.3, 0.21), (2.0, 1.0)])
def test_ratio_decays_linearly_to_its_floor_and_resets_when_idle(c: float, init: float) -> None:
    rsv = OutputReservation(c, block_size=16)
    assert rsv.ratio == pytest.approx(init)
    floor = init * 0.14
    running = [make_request("a", 4, 100)]
    rsv.step_done(running, preempted=False)
    assert rsv.ratio == pytest.approx(init - (init - floor) / 600)
    for _ in range(299):
        rsv.step_done(running, preempted=False)
    assert rsv.ratio == pytest.approx((init + floor) / 2)  # halfway after 300 of the 600 steps
    for _ in range(400):
        rsv.step_done(running, preempted=False)
    assert rsv.ratio == pytest.approx(floor)  # and it stays there
    rsv.step_done([], preempted=False)  # nothing to run
    assert rsv.ratio == pytest.approx(init)


def test_a_preemption_sets_the_ratio_to_sglangs_retraction_estimate() -> None:
    rsv = OutputReservation(1.0, block_size=16)
    for _ in range(600):
        rsv.step_done([make_request("x", 4, 100)], preempted=False)
    assert rsv.ratio == pytest.approx(0.098)
    still_running = [make_request("a", 4, 100, generated=30), make_request("b", 4, 100, generated=50)]
    rsv.step_done(still_running, preempted=True)
    assert rsv.ratio == pytest.approx((30 + 50 + 20 * 2) / (200 + 1))  # back up from the floor
    rsv.step_done(still_running, preempted=False)  # and decays from there
    assert rsv.ratio == pytest.approx((30 + 50 + 40) / 201 - (0.7 - 0.098) / 600)
    rsv.step_done([make_request("c", 4, 10, generated=9)], preempted=True)
    assert rsv.ratio == 1.0  # (9 + 20) / 11, capped


def test_conservativeness_must_be_positive_for_a_reservation() -> None:
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="schedule_conservativeness"):
            OutputReservation(bad, block_size=16)
    for bad in (-0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="schedule_conservativeness"):
            EngineConfig(num_blocks=64, schedule_conservativeness=bad)


# ---- the arithmetic ----------------------------------------------------------------------------------------------
def test_fits_reserves_ratio_of_remaining_outputs_and_ignore_eos_outputs_whole() -> None:
    rsv = OutputReservation(0.5, block_size=4)  # ratio 0.35
    a = make_request("a", 4, 20, generated=4)  # 16 left
    rsv.admitted(a)
    b = make_request("b", 8, 12)
    assert rsv.reserved_tokens(b) == pytest.approx(0.35 * (16 + 12))  # 9.8 tokens: 3 blocks of 4
    assert rsv.fits(b, spare_blocks=3) and not rsv.fits(b, spare_blocks=2)
    assert not rsv.fits(b, spare_blocks=3, extra_tokens=3)  # the rest of b's prompt counts in full
    e = make_request("e", 8, 12, ignore_eos=True)  # will produce all 12
    assert rsv.reserved_tokens(e) == pytest.approx(12 + 0.35 * 16)
    rsv.admitted(e)
    assert rsv.reserved_tokens() == pytest.approx(12 + 0.35 * 16)
    rsv.decoded(_grow(e))
    rsv.decoded(_grow(a))
    assert rsv.reserved_tokens() == pytest.approx(11 + 0.35 * 15)
    rsv.released(a)
    rsv.released(e)
    assert rsv.reserved_tokens() == 0 and rsv.num_running == 0


def _grow(r: Request) -> Request:
    r.output_token_ids.append(7)
    return r


def test_remaining_output_is_clipped_and_capped_by_max_model_len() -> None:
    rsv = OutputReservation(10.0, block_size=16)  # ratio 1
    long = make_request("l", 100, None, ignore_eos=True, max_model_len=100_000)  # no max_tokens: 99,900 left
    assert rsv.reserved_tokens(long) == CLIP_MAX_NEW_TOKENS
    rsv.admitted(long)
    rsv.decoded(_grow(long))  # still far above the clip: the reservation does not shrink
    assert rsv.reserved_tokens() == CLIP_MAX_NEW_TOKENS
    near = make_request("n", 100, 5000, generated=904, ignore_eos=True)  # 4096 left
    rsv.admitted(near)
    rsv.decoded(_grow(near))
    assert rsv.reserved_tokens() == 2 * CLIP_MAX_NEW_TOKENS - 1
    short = make_request("s", 60, 1000, max_model_len=100)  # max_model_len leaves 40
    assert rsv.reserved_tokens(short) == 2 * CLIP_MAX_NEW_TOKENS - 1 + 40


def test_a_request_is_always_admitted_when_nothing_runs() -> None:
    rsv = OutputReservation(10.0, block_size=16)
    assert rsv.fits(make_request("a", 16, 4000, ignore_eos=True), spare_blocks=0)


# ---- in the scheduler --------------------------------------------------------------------------------------------
def _run(sched: Scheduler, ex: FakeExecutor, steps: int = 1000) -> list[StepPlan]:
    plans: list[StepPlan] = []
    for _ in range(steps):
        plan = sched.schedule()
        if plan is None:
            break
        sched.update(plan, ex.execute(plan))
        assert sched.pool.check_accounting(sched.live_block_refs()).ok
        plans.append(plan)
    assert not sched.requests
    return plans


def _three_requests(c: float) -> tuple[Scheduler, FakeExecutor]:
    cfg = EngineConfig(num_blocks=16, block_size=4, max_model_len=64, schedule_conservativeness=c)
    sched = Scheduler(cfg)
    for i in range(3):  # 8 prompt + 24 output tokens = 8 blocks each: two fit at once
        sched.add(Request(f"r{i}", [100 * i + j for j in range(1, 9)], SamplingParams(max_tokens=24, ignore_eos=True),
                          0.0, max_model_len=64))
    return sched, FakeExecutor(16, 4)


def test_admission_waits_for_room_for_outputs_instead_of_preempting_later() -> None:
    sched, ex = _three_requests(1.0)
    plans = _run(sched, ex)
    admitted = [(i, nr.request_id) for i, p in enumerate(plans) for nr in p.new_requests]
    assert [rid for _, rid in admitted] == ["r0", "r1", "r2"]
    assert admitted[0][0] == admitted[1][0] == 0  # r0 and r1 fit with their outputs
    finished_r0 = next(i for i, p in enumerate(plans) if "r0" in p.finished_ids)
    assert admitted[2][0] == finished_r0  # r2 waits until r0's blocks come back, then starts
    assert sched.num_preemptions == 0

    sched0, ex0 = _three_requests(0.0)  # without the reservation all three start and one is preempted later
    plans0 = _run(sched0, ex0)
    assert [nr.request_id for nr in plans0[0].new_requests] == ["r0", "r1", "r2"]
    assert sched0.num_preemptions > 0


def test_admission_refuses_head_of_line_until_the_reservation_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    # the sum alone (the check that follows its refusals: test_admission_finish_time.py)
    monkeypatch.setattr(admission.OutputReservation, "fits_by_finish_time", lambda *args, **kwargs: False)
    cfg = EngineConfig(num_blocks=20, block_size=4, max_model_len=64, schedule_conservativeness=1.0)
    sched = Scheduler(cfg)
    ex = FakeExecutor(20, 4)

    def add(rid: str, first: int, prompt: int, max_tokens: int) -> None:  # ignore_eos: reserved whole, any ratio
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sched.add(Request(rid, list(range(first, first + prompt)), sp, 0.0, max_model_len=64))

    def step() -> StepPlan:
        plan = sched.schedule()
        assert plan is not None
        sched.update(plan, ex.execute(plan))
        return plan

    add("big", 1, 8, 40)
    step()  # big runs alone: 2 blocks, 1 of its 40 outputs
    add("small", 50, 4, 4)
    # big's next token takes a 3rd block; small's prompt a 4th: 16 spare blocks (64 tokens) >= 39 + 4 reserved
    assert [nr.request_id for nr in step().new_requests] == ["small"]
    add("long", 60, 4, 24)
    add("tiny", 70, 2, 1)
    # small takes its 2nd block and long's prompt would take one: 14 spare (56 tokens) < 38 + 3 + 24 reserved
    plan = step()
    assert plan.new_requests == []  # long does not fit, and tiny waits behind it (fcfs: head of line)
    assert sched._reserve is not None and sched._reserve.reserved_tokens() == 37 + 2  # after the step's tokens
    assert [nr.request_id for nr in step().new_requests] == []
    plans = _run(sched, ex)  # both get in once small's and big's outputs have shrunk enough
    assert {nr.request_id for p in plans for nr in p.new_requests} == {"long", "tiny"}
    assert sched.num_preemptions == 0


def _random_workload(seed: int, n: int = 24) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 99) for _ in range(12)]
    work = []
    for _ in range(n):
        prompt = (shared[: rng.choice([0, 4, 8, 12])] + [rng.randrange(1, 99) for _ in range(rng.randint(1, 20))])
        work.append((prompt, SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.5)))
    return work


def _plans(c: float | None, seed: int, num_blocks: int, overlap: bool) -> list[StepPlan]:
    kw = {} if c is None else {"schedule_conservativeness": c}
    cfg = EngineConfig(num_blocks=num_blocks, block_size=4, max_num_seqs=6, chunked_prefill_size=16, max_model_len=48,
                       eos_token_ids={0}, **kw)
    ex = FakeExecutor(num_blocks, 4, vocab_size=40)
    core = EngineCore(cfg, ex, overlap=overlap)
    for i, (prompt, sp) in enumerate(_random_workload(seed)):
        core.add_request(f"r{i}", prompt, sp)
    for _ in range(3000):
        if not core.has_work():
            break
        core.step()
    assert not core.has_work() and core.check_accounting().ok
    return ex.plans


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_conservativeness_zero_plans_exactly_as_without_the_knob(seed: int, overlap: bool) -> None:
    tight = _plans(None, seed, num_blocks=14, overlap=overlap)
    assert sum(len(p.new_requests) for p in tight) > 24  # a pool this small preempts: requests come back
    assert _plans(0.0, seed, num_blocks=14, overlap=overlap) == tight
    # and a reservation that never binds (a pool far larger than the work) changes no plan either
    assert _plans(1.0, seed, num_blocks=4000, overlap=overlap) == _plans(None, seed, num_blocks=4000, overlap=overlap)


# ---- running totals ----------------------------------------------------------------------------------------------
def _assert_totals_match_a_recount(sched: Scheduler) -> None:
    rsv = sched._reserve
    assert rsv is not None
    certain = sum(min(r.max_output_tokens - r.num_output_tokens, CLIP_MAX_NEW_TOKENS)
                  for r in sched.running if r.sampling_params.ignore_eos)
    estimated = sum(min(r.max_output_tokens - r.num_output_tokens, CLIP_MAX_NEW_TOKENS)
                    for r in sched.running if not r.sampling_params.ignore_eos)
    assert (rsv.num_running, rsv.certain, rsv.estimated) == (len(sched.running), certain, estimated)


class _CheckedCore(EngineCore):
    def step(self):  # type: ignore[override]
        deltas = super().step()
        _assert_totals_match_a_recount(self.scheduler)
        return deltas


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=ops_st(PREFIXES), c=st.sampled_from([0.05, 0.3, 1.0, 3.0]),
       mode=st.sampled_from(["sync", "overlap", "drafts"]))
def test_random_workloads_keep_exact_totals_and_generate_what_they_generate_alone(
    cfg: dict, ops: list, c: float, mode: str
) -> None:
    k = 2 if mode == "drafts" else 0  # speculative decoding appends several tokens per step
    config = engine_config({**cfg, "schedule_conservativeness": c, "num_speculative_tokens": k})
    ex = FakeExecutor(config.num_blocks, config.block_size, vocab_size=48, num_speculative_tokens=k,
                      max_model_len=config.max_model_len)
    core = _CheckedCore(config, ex, overlap=mode == "overlap")
    run = drive(core, ops, PREFIXES)
    stats = core.stats()
    assert stats.blocks_owned == 0 and stats.blocks_free + stats.blocks_cached == config.num_blocks
    rsv = core.scheduler._reserve
    assert rsv is not None and (rsv.num_running, rsv.certain, rsv.estimated) == (0, 0, 0)
    assert_each_generates_what_it_generates_alone(ex, run)


# ---- the point of the feature ------------------------------------------------------------------------------------
def _benchmark_shape(c: float, ignore_eos: bool = True, seed: int = 0) -> tuple[EngineCore, FakeExecutor, dict]:
    """The Llama-3.1-8B throughput run scaled down: 64 blocks of 16 tokens, 48 requests of 64 in / 64 out,
    max_num_seqs 16 (the cache holds 8 of them at full length). Without ignore_eos, each request stops after a
    length drawn in [1, 64] (its first prompt token says which), so the ratio's estimate is what reserves."""
    rng = random.Random(seed)
    eos = 0
    prompts = [[1000 + rng.randint(1, 64)] + [(i * 131 + j) % 997 + 1 for j in range(63)] for i in range(48)]

    def next_token(history: list[int]) -> int:
        if not ignore_eos and len(history) - 63 >= history[0] - 1000:
            return eos
        return (len(history) * 7 + history[-1]) % 997 + 1

    cfg = EngineConfig(num_blocks=64, block_size=16, max_num_seqs=16, max_model_len=256, eos_token_ids={eos},
                       schedule_conservativeness=c)
    ex = FakeExecutor(64, 16, next_token=next_token)
    core = EngineCore(cfg, ex)
    sp = SamplingParams(max_tokens=64, ignore_eos=ignore_eos)
    outputs: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, sp)
    while core.has_work():
        for d in core.step():
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
    assert core.check_accounting().ok
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == reference_generation(next_token, p, 64, 256, frozenset({eos}),
                                                        ignore_eos=ignore_eos)[0]
    return core, ex, outputs


def test_the_benchmark_shape_preempts_without_the_reservation_and_never_with_it() -> None:
    core0, ex0, _ = _benchmark_shape(0.0)
    core1, ex1, _ = _benchmark_shape(1.0)
    assert core0.stats().num_preemptions > 0
    assert core1.stats().num_preemptions == 0
    # nothing recomputed: every request computes its 64 prompt tokens and 63 decodes once (the last token
    # is sampled, never fed back); without the reservation the preempted ones compute theirs again
    assert sum(p.num_tokens for p in ex1.plans) == 48 * (64 + 63) < sum(p.num_tokens for p in ex0.plans)


def test_outputs_that_stop_early_are_reserved_by_the_ratio() -> None:
    core0, ex0, _ = _benchmark_shape(0.0, ignore_eos=False)
    core1, ex1, _ = _benchmark_shape(1.0, ignore_eos=False)
    assert core0.stats().num_preemptions > 0
    assert core1.stats().num_preemptions < core0.stats().num_preemptions
    assert sum(p.num_tokens for p in ex1.plans) < sum(p.num_tokens for p in ex0.plans)
