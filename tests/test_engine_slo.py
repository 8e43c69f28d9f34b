"""scheduler.policy = "slo" (engine/slo.py): the measured step-cost model, shortest-prefill-first and priority
ordering, priority's preemption victim, and decodes kept within slo_tbt_ms while a long prompt arrives (against
fcfs on the same simulated clock)."""
from __future__ import annotations

from itertools import pairwise

import pytest

from appliance.engine.config import EngineConfig
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.request import DECODING, Request
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.scheduler import Scheduler
from appliance.engine.slo import StepCostModel
from appliance.engine.step import StepPlan

BASE_S, PER_TOKEN_S = 0.010, 0.001  # the simulated device: a step = 10 ms + 1 ms per prefill token


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Harness:
    """A scheduler and a FakeExecutor on a simulated clock that charges each step BASE_S + PER_TOKEN_S x its
    prefill tokens; records every decode token's time per request."""

    def __init__(self, **cfg) -> None:
        cfg.setdefault("num_blocks", 256)
        cfg.setdefault("block_size", 4)
        cfg.setdefault("max_model_len", 1024)
        self.cfg = EngineConfig(**cfg)
        self.clock = Clock()
        self.sched = Scheduler(self.cfg, clock=self.clock)
        self.ex = FakeExecutor(self.cfg.num_blocks, self.cfg.block_size, vocab_size=1000)
        self.token_times: dict[str, list[float]] = {}

    def add(self, rid: str, n_prompt: int, max_tokens: int = 400, priority: int = 0) -> Request:
        first = 1000 * (len(self.sched.requests) + len(self.token_times) + 1)
        r = Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens,
                                                                              priority=priority),
                    self.clock(), max_model_len=self.cfg.max_model_len)
        self.sched.add(r)
        return r

    def step(self) -> StepPlan:
        plan = self.sched.schedule()
        assert plan is not None
        decoding = {rid for rid, r in self.sched.requests.items() if r.status is DECODING}
        prefill = sum(s.num_tokens for s in plan.scheduled if s.request_id not in decoding)
        self.clock.t += BASE_S + PER_TOKEN_S * prefill
        for d in self.sched.update(plan, self.ex.execute(plan)):
            self.token_times.setdefault(d.request_id, []).append(self.clock.t)
        rep = self.sched.pool.check_accounting(self.sched.live_block_refs())
        assert rep.ok, rep.problems
        return plan


def test_cost_model_measures_base_then_per_token() -> None:
    m = StepCostModel()
    m.observe(0.5, 100)  # no base yet: a prefill step cannot be split
    assert m.prefill_room(1.0) is None
    m.observe(0.010, 0)
    m.observe(0.110, 100)
    assert m.base_s == pytest.approx(0.010) and m.per_token_s == pytest.approx(0.001)
    assert m.prefill_room(0.050) == 40 and m.prefill_room(0.005) == 0
    m.observe(0.020, 0)  # moving average
    assert m.base_s == pytest.approx(0.8 * 0.010 + 0.2 * 0.020)


def test_waiting_prompts_shortest_first_and_priority_before_length() -> None:
    h = Harness(policy="slo", max_num_seqs=1, chunked_prefill_size=64)
    h.add("long", 40, max_tokens=1)
    h.add("short", 8, max_tokens=1)
    h.add("mid", 20, max_tokens=1)
    order = [n.request_id for _ in range(3) for n in h.step().new_requests]
    assert order == ["short", "mid", "long"]
    h.add("long-urgent", 40, max_tokens=1, priority=-1)
    h.add("short-late", 8, max_tokens=1, priority=1)
    h.add("short-normal", 8, max_tokens=1)
    order = [n.request_id for _ in range(3) for n in h.step().new_requests]
    assert order == ["long-urgent", "short-normal", "short-late"]


def test_fcfs_keeps_arrival_order_and_refuses_priority() -> None:
    h = Harness(policy="fcfs", max_num_seqs=1, chunked_prefill_size=64)
    h.add("long", 40, max_tokens=1)
    h.add("short", 8, max_tokens=1)
    assert [n.request_id for n in h.step().new_requests] == ["long"]
    with pytest.raises(ValueError, match="priority needs scheduler.policy"):
        h.add("urgent", 8, priority=-1)


def test_slo_needs_chunked_prefill() -> None:
    with pytest.raises(ValueError, match="needs chunked prefill"):
        EngineConfig(num_blocks=64, max_model_len=128, policy="slo", chunked_prefill_size=-1)


def test_preemption_takes_the_lowest_priority_first() -> None:
    # 12 blocks of 4: three requests of 12 prompt tokens take 9; growing, one must go
    h = Harness(policy="slo", num_blocks=12, max_model_len=48, chunked_prefill_size=64)
    h.add("old-low", 12, max_tokens=30, priority=5)
    h.add("mid", 12, max_tokens=30)
    h.add("new-high", 12, max_tokens=30, priority=-5)
    h.step()
    while h.sched.num_preemptions == 0:
        h.step()
    preempted = [r.request_id for r in h.sched.requests.values() if r.num_preemptions]
    assert preempted == ["old-low"]  # fcfs's rule would take the newest


def decode_gaps(h: Harness, rid: str) -> list[float]:
    t = h.token_times[rid]
    return [b - a for a, b in pairwise(t)]


@pytest.mark.parametrize("policy", ["slo", "fcfs"])
def test_decodes_keep_their_deadline_while_a_long_prompt_arrives(policy: str) -> None:
    tbt_s = 0.050
    h = Harness(policy=policy, slo_tbt_ms=tbt_s * 1000, chunked_prefill_size=256)
    for i in range(4):
        h.add(f"d{i}", 16, max_tokens=200)
    for _ in range(5):  # prefill, then decode-only steps: the cost model learns the base
        h.step()
    h.add("long", 600, max_tokens=2)
    steps = 0
    while "long" not in h.token_times:
        h.step()
        steps += 1
        assert steps < 200, "the long prompt never finished its prefill"
    gaps = [g for i in range(4) for g in decode_gaps(h, f"d{i}")[4:]]  # from the long prompt's arrival on
    if policy == "fcfs":
        assert max(gaps) == pytest.approx(BASE_S + PER_TOKEN_S * 252)  # a full chunk beside 4 decodes
        return
    # slo: the first prefill step is unmeasured (nothing to cap with); every later step fits the deadline
    late = [g for g in gaps if g > tbt_s + 1e-9]
    assert len(late) == 4 and len(gaps) > 4 * steps - 4  # that one step's four decodes; every step decoded
    # after its first chunk of 252 the prompt advanced in capped chunks of (50 - 10) ms / 1 ms = 40 tokens
    assert steps == 1 + -(-(600 - 252) // 40)
