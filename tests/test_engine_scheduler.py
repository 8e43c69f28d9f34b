"""Scheduler: token budget, chunked prefill, decode-first ordering, seats, preemption, admission, policies."""
from __future__ import annotations

import dataclasses

import pytest

from appliance.engine.config import EngineConfig
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.request import Request, RequestStatus
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.scheduler import QueueFull, Scheduler
from appliance.engine.step import StepPlan


class Harness:
    """A scheduler wired to a FakeExecutor that checks every plan like a worker would."""

    def __init__(self, **cfg) -> None:
        cfg.setdefault("num_blocks", 64)
        cfg.setdefault("block_size", 4)
        cfg.setdefault("max_model_len", 128)
        self.cfg = EngineConfig(**cfg)
        self.sched = Scheduler(self.cfg)
        self.ex = FakeExecutor(self.cfg.num_blocks, self.cfg.block_size, vocab_size=1000)

    def add(self, rid: str, n_prompt: int, max_tokens: int = 50, first: int | None = None) -> Request:
        if first is None:  # distinct prompts unless a test wants shared prefixes
            first = 1000 * (len(self.ex.plans) + len(self.sched.requests) + 1) + 7 * len(rid)
        r = Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens), 0.0,
                    max_model_len=self.cfg.max_model_len)
        self.sched.add(r)
        return r

    def step(self) -> StepPlan:
        plan = self.sched.schedule()
        assert plan is not None
        self.sched.update(plan, self.ex.execute(plan))
        rep = self.sched.pool.check_accounting(self.sched.live_block_refs())
        assert rep.ok, rep.problems
        return plan


def tokens(plan: StepPlan) -> dict[str, int]:
    return {s.request_id: s.num_tokens for s in plan.scheduled}


def test_long_prompt_is_chunked_within_a_16_token_budget() -> None:
    h = Harness(chunked_prefill_size=16)
    h.add("a", 40)
    plans = [h.step() for _ in range(3)]
    assert [tokens(p) for p in plans] == [{"a": 16}, {"a": 16}, {"a": 8}]
    assert [p.scheduled[0].sample for p in plans] == [False, False, True]
    assert len(plans[0].new_requests) == 1 and plans[1].new_requests == []
    # blocks arrive with the chunk that needs them: 16 tokens = 4 blocks, and 2 more for the last 8
    assert [len(p.scheduled[0].new_block_ids) for p in plans[1:]] == [4, 2]
    assert h.sched.requests["a"].num_output_tokens == 1


def test_decodes_first_then_prefill_chunks_share_the_budget() -> None:
    h = Harness(chunked_prefill_size=16)
    h.add("a", 3)
    h.add("b", 5)
    h.step()  # both prefills fit (8 tokens)
    h.add("c", 30)
    p = h.step()
    assert [s.request_id for s in p.scheduled] == ["a", "b", "c"]
    assert tokens(p) == {"a": 1, "b": 1, "c": 14}  # c gets what the decodes left
    h.add("d", 30)
    p = h.step()
    assert tokens(p) == {"a": 1, "b": 1, "c": 14}  # running chunked prefill goes before the new request
    assert p.num_tokens <= 16
    p = h.step()
    assert tokens(p) == {"a": 1, "b": 1, "c": 2, "d": 12}  # c's last chunk samples its first token
    p = h.step()
    assert tokens(p) == {"a": 1, "b": 1, "c": 1, "d": 13}
    assert [s.request_id for s in p.scheduled] == ["a", "b", "c", "d"]


def test_every_plan_respects_budget_and_max_num_seqs() -> None:
    h = Harness(chunked_prefill_size=16, max_num_seqs=3)
    for i in range(7):
        h.add(f"r{i}", 6 + i, max_tokens=5)
    seen_running = 0
    while h.sched.requests:
        p = h.step()
        assert p.num_tokens <= 16
        assert len(p.scheduled) <= 3
        seen_running = max(seen_running, len(h.sched.running))
    assert seen_running == 3


def test_no_chunking_never_splits_and_lets_an_oversized_prompt_run_alone() -> None:
    h = Harness(chunked_prefill_size=-1, max_prefill_tokens=10)
    h.add("a", 6)
    h.add("b", 6)
    p = h.step()
    assert tokens(p) == {"a": 6}  # b would overflow the 10-token prefill budget
    h.add("big", 25)
    p = h.step()
    assert tokens(p) == {"a": 1, "b": 6}  # decodes are not charged; big waits behind b (fcfs)
    p = h.step()
    assert tokens(p) == {"a": 1, "b": 1, "big": 25}  # over budget, but the step's only prefill


def test_preemption_picks_the_newest_and_requeues_it_at_the_front() -> None:
    # 6 blocks of 4 tokens = 24 slots; three requests of 8 tokens grow until one must go.
    h = Harness(num_blocks=6, block_size=4, max_model_len=24, chunked_prefill_size=64)
    for rid in ("a", "b", "c"):
        h.add(rid, 8, max_tokens=12)
    h.step()
    assert h.sched.pool.num_available == 0
    h.add("late", 3)
    p = h.step()  # a needs a 3rd block: c (newest) is preempted, its 2 blocks serve a and b
    assert h.sched.num_preemptions == 1 and tokens(p) == {"a": 1, "b": 1}
    assert "c" in p.finished_ids and h.sched.requests["c"].status is RequestStatus.PREEMPTED
    assert h.sched.waiting[0].request_id == "c" and h.sched.waiting[-1].request_id == "late"
    assert "c" not in tokens(p) and p.new_requests == []  # no admission in a step that preempted
    assert h.sched.requests["c"].block_ids == [] and h.sched.requests["c"].num_computed_tokens == 0


def test_preempted_request_is_resent_with_its_generated_tokens() -> None:
    h = Harness(num_blocks=6, block_size=4, max_model_len=24, chunked_prefill_size=64)
    for rid in ("a", "b", "c"):
        h.add(rid, 8, max_tokens=12)
    first_c = h.sched.requests["c"].prompt_token_ids[0]
    h.step()
    h.step()  # preempts c
    resent = None
    while h.sched.requests and resent is None:
        p = h.step()
        resent = next((n for n in p.new_requests if n.request_id == "c"), None)
    assert resent is not None
    # c was preempted after generating one token; it comes back with it, as output, to recompute
    assert resent.num_prompt_tokens == 8 and len(resent.token_ids) == 9
    assert resent.token_ids[:8] == list(range(first_c, first_c + 8))
    assert resent.block_ids and len(resent.block_ids) == 3  # 9 tokens in blocks of 4


def test_queue_limit_and_duplicate_ids() -> None:
    h = Harness(max_queued_requests=2)
    h.add("a", 3)
    h.add("b", 3)
    assert not h.sched.can_queue()
    with pytest.raises(QueueFull):
        h.add("c", 3)
    h.step()  # both admitted: the queue has room again
    assert h.sched.can_queue()
    with pytest.raises(ValueError, match="already in use"):
        h.add("a", 3)


def test_lpm_admits_the_longest_cached_prefix_first() -> None:
    h = Harness(policy="lpm", max_num_seqs=1, chunked_prefill_size=64)
    h.add("warm", 12, max_tokens=1, first=100)
    h.step()  # warm finishes and leaves 2 full blocks (of tokens 100..107) cached
    h.add("cold", 12, first=500)
    h.add("hot", 12, first=100)
    p = h.step()
    assert [n.request_id for n in p.new_requests] == ["hot"]
    assert p.new_requests[0].num_computed_tokens == 8


def test_fcfs_keeps_arrival_order_despite_cache_hits() -> None:
    h = Harness(policy="fcfs", max_num_seqs=1, chunked_prefill_size=64)
    h.add("warm", 12, max_tokens=1, first=100)
    h.step()
    h.add("cold", 12, first=500)
    h.add("hot", 12, first=100)
    assert [n.request_id for n in h.step().new_requests] == ["cold"]


def test_abort_mid_prefill_frees_blocks_and_tells_workers() -> None:
    h = Harness(chunked_prefill_size=8)
    h.add("a", 30)
    h.step()
    assert h.sched.pool.num_owned == 2
    assert h.sched.abort("a") is not None
    assert h.sched.pool.num_owned == 0 and h.sched.pending_forget == ("a",)
    assert h.sched.abort("a") is None
    h.add("b", 3)
    assert h.step().finished_ids == ["a"]


def test_abort_of_a_never_scheduled_request_tells_workers_nothing() -> None:
    h = Harness()
    h.add("a", 3)
    h.sched.abort("a")
    assert h.sched.pending_forget == () and h.sched.schedule() is None


def test_decodes_beyond_the_budget_take_turns() -> None:
    h = Harness(chunked_prefill_size=16, max_num_seqs=8)
    for i in range(5):
        h.add(f"r{i}", 1, max_tokens=100)
    h.step()
    assert all(r.status is RequestStatus.DECODING for r in h.sched.requests.values())
    h.sched.config = dataclasses.replace(h.cfg, chunked_prefill_size=3)  # now 5 decodes share 3 tokens
    counts = {f"r{i}": 0 for i in range(5)}
    for _ in range(10):
        p = h.step()
        assert p.num_tokens == 3
        for rid in tokens(p):
            counts[rid] += 1
    assert set(counts.values()) == {6}  # 30 decode slots shared evenly, nobody starves
