"""The finish-time admission check (engine/admission.py `OutputReservation.fits_by_finish_time`, SGLang's
PrefillAdder.add_one_req_ignore_eos): it admits what the reservation sum holds back and refuses what would outgrow
the pool, counts a prompt's prefill steps and keeps shared prefixes held, and on random ignore_eos workloads never
preempts where the sum alone does not."""
from __future__ import annotations

import random

import pytest
from engine_workload import make_request

from appliance.engine import EngineConfig, EngineCore, SamplingParams
from appliance.engine.admission import OutputReservation
from appliance.engine.fake_executor import FakeExecutor


def _sum_alone(*args: object, **kwargs: object) -> bool:
    """The finish-time check refusing everything: admission by the reservation sum alone."""
    return False


def _head_start_run(head_start: int, finish_time: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, int], int]:
    """r0 runs alone for head_start steps, then r1 and r2 arrive; 16-token prompts + 64 outputs (5 blocks each) in
    a pool of 12. Returns the step each of r1, r2 started at, and the preemptions."""
    with monkeypatch.context() as patched:
        if not finish_time:
            patched.setattr(OutputReservation, "fits_by_finish_time", _sum_alone)
        return _head_start(head_start)


def _head_start(head_start: int) -> tuple[dict[str, int], int]:
    cfg = EngineConfig(num_blocks=12, block_size=16, max_num_seqs=8, max_model_len=128, eos_token_ids={0},
                       schedule_conservativeness=1.0)
    core = EngineCore(cfg, FakeExecutor(12, 16), overlap=False)
    sp = SamplingParams(max_tokens=64, ignore_eos=True)
    core.add_request("r0", list(range(1, 17)), sp)
    for _ in range(head_start):
        core.step()
    core.add_request("r1", list(range(21, 37)), sp)
    core.add_request("r2", list(range(41, 57)), sp)
    started: dict[str, int] = {}
    step = 0
    while core.has_work():
        core.step()
        step += 1
        for rid in ("r1", "r2"):
            req = core.get_request(rid)
            if rid not in started and (req is None or req.num_computed_tokens > 0):
                started[rid] = step
    return started, core.stats().num_preemptions


def test_finish_time_check_starts_a_request_the_sum_holds_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # r0 has 15 outputs left after 49 steps: the sum reserves 15 + 64 + 64 tokens, 5 spare blocks hold 80
    started, preempted = _head_start_run(49, False, monkeypatch)
    assert started == {"r1": 1, "r2": 16} and preempted == 0  # r2 waits for r0
    # r0 gives its 5 blocks back after 15 steps, before r1 and r2 outgrow the pool: both start at once
    started, preempted = _head_start_run(49, True, monkeypatch)
    assert started == {"r1": 1, "r2": 1} and preempted == 0


def test_finish_time_check_refuses_what_would_outgrow_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    # r0 with 40 outputs left: all three would need 13 of the 12 blocks before r0 finishes, so r2 waits
    started, preempted = _head_start_run(25, True, monkeypatch)
    assert started["r1"] == 1 and started["r2"] > 1 and preempted == 0


def test_finish_time_check_waits_for_a_prompt_still_prefilling() -> None:
    """The new request's prompt goes in at the budget left beside one decode row per request, so it finishes
    later than its outputs alone say: a 40-token rest at 5 tokens a step adds 7 steps (the 8th chunk's step
    samples its first output), and the peak then needs 16 spare blocks where 14 would do without them."""
    rsv = OutputReservation(1.0, block_size=4, step_tokens=7)
    a = make_request("a", 8, 10, generated=2, ignore_eos=True)  # 8 outputs left, 10 tokens now (3 blocks)
    a.block_ids = [0, 1, 2]
    rsv.running = [a]
    rsv.admitted(a)
    new = make_request("b", 44, 4, ignore_eos=True)  # first chunk 4 tokens (1 block), 40 to come, 4 outputs
    # a finishes first (8 steps; b: 4 + 7): (10 + 44 tokens + 2 x 8) / 4 + 2 margin - 4 held = 15.5 blocks
    assert rsv.fits_by_finish_time(new, spare_blocks=16, extra_tokens=40)
    assert not rsv.fits_by_finish_time(new, spare_blocks=15, extra_tokens=40)
    assert rsv.fits_by_finish_time(new, spare_blocks=14, extra_tokens=0)  # the same outputs, its prompt all in
    rsv.step_tokens = 2  # no budget left beside the decodes: prompts would starve, nothing to simulate
    assert not rsv.fits_by_finish_time(new, spare_blocks=100, extra_tokens=40)


def test_finish_time_check_keeps_shared_prefixes_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finish gives back only the blocks no one else holds: with every block of `a` shared by the new request's
    prefix hit, a's finish frees nothing, and b must fit beside what a held."""
    rsv = OutputReservation(1.0, block_size=4, step_tokens=64)
    a = make_request("a", 8, 4, generated=2, ignore_eos=True)  # 2 outputs left, 10 tokens now, blocks 0..2
    a.block_ids = [0, 1, 2]
    rsv.running = [a]
    rsv.admitted(a)
    b = make_request("b", 8, 20, ignore_eos=True)  # its 8-token prompt: 2 blocks; 28 tokens (7 blocks) when done
    # after a finishes b needs 7 + 1 margin - 2 held = 6 blocks more: 4 spare + a's 3 without a hit, + 1 with one
    free_after_a = rsv.fits_by_finish_time(b, spare_blocks=4, extra_tokens=0, hit=[])
    keeps_shared = rsv.fits_by_finish_time(b, spare_blocks=4, extra_tokens=0, hit=[0, 1])
    assert free_after_a and not keeps_shared


def test_finish_time_check_never_preempts_where_the_sum_does_not(monkeypatch: pytest.MonkeyPatch) -> None:
    """Random ignore_eos workloads (shared prefixes, arrivals while others run, small step budgets, both loops):
    the check admits requests the sum refuses, and no seed preempts with it unless it also does without."""
    admitted = 0
    real = OutputReservation.fits_by_finish_time

    def counting(self: OutputReservation, *args: object, **kwargs: object) -> bool:
        nonlocal admitted
        ok = real(self, *args, **kwargs)  # type: ignore[arg-type]
        admitted += ok
        return ok

    monkeypatch.setattr(OutputReservation, "fits_by_finish_time", counting)
    for seed in range(300):
        runs = {}
        for on in (True, False):
            with monkeypatch.context() as patched:
                if not on:
                    patched.setattr(OutputReservation, "fits_by_finish_time", _sum_alone)
                runs[on] = _ignore_eos_run(seed)
        assert runs[True] == 0 or runs[False] > 0, seed
    assert admitted > 200


def _ignore_eos_run(seed: int) -> int:
    """Preemptions of one random ignore_eos workload; every block accounted for at the end."""
    rng = random.Random(seed)
    nb = rng.randint(12, 60)
    cfg = EngineConfig(num_blocks=nb, block_size=4, max_num_seqs=rng.randint(2, 8),
                       chunked_prefill_size=rng.choice([8, 16, 32, 64]), max_model_len=min(nb * 4, 96),
                       eos_token_ids={0}, schedule_conservativeness=1.0)
    core = EngineCore(cfg, FakeExecutor(nb, 4, vocab_size=40), overlap=rng.random() < 0.5)
    shared = [rng.randrange(1, 39) for _ in range(16)]
    for i in range(rng.randint(3, 20)):
        prompt = shared[: rng.choice([0, 4, 8, 16])] + [rng.randrange(1, 39) for _ in range(rng.randint(1, 40))]
        core.add_request(f"r{i}", prompt[: cfg.max_model_len - 1],
                         SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True))
        if rng.random() < 0.3:
            for _ in range(rng.randint(0, 10)):
                if core.has_work():
                    core.step()
    while core.has_work():
        core.step()
    assert core.check_accounting().ok
    return core.stats().num_preemptions
