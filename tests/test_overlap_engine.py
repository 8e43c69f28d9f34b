"""Overlap scheduling (EngineCore(overlap=True)) on the FakeExecutor: one step always in flight.

The executor below runs each step lazily, when its result is collected, in submission order: like a device
stream, nothing of step N is visible to the host before collect, and plan N+1 is validated against the worker
state after step N ran. Random arrivals, aborts, EOS finishes and tiny pools (preemption): no block leaks or is
owned twice, no delta follows a finish, and every request that was not aborted generates exactly what it
generates alone (and what the synchronous loop gives it), max_tokens included.
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.engine import EngineConfig, EngineCore, SamplingParams
from appliance.engine.fake_executor import FakeExecutor, reference_generation
from appliance.engine.step import StepPlan, StepResult

EOS = 0
PREFIXES = ([], [11, 12, 13, 14], [11, 12, 13, 14, 15, 16, 17, 18])


class LazyFakeExecutor(FakeExecutor):
    """Runs a submitted step only when it (or a later one) is collected, in submission order."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.queue: list[StepPlan] = []
        self.done: dict[int, StepResult] = {}
        self.calls: list[tuple[str, int]] = []

    def submit(self, plan: StepPlan) -> object:
        self.calls.append(("submit", plan.step_id))
        self.queue.append(plan)
        return plan.step_id

    def collect(self, handle: object) -> StepResult:
        assert isinstance(handle, int)
        self.calls.append(("collect", handle))
        while handle not in self.done:
            plan = self.queue.pop(0)
            self.done[plan.step_id] = self.execute(plan)
        return self.done.pop(handle)


config_st = st.builds(
    dict,
    block_size=st.sampled_from([2, 4]),
    extra_blocks=st.sampled_from([0, 0, 1, 2, 3, 6, 24]),
    max_num_seqs=st.integers(1, 8),
    chunked_prefill_size=st.sampled_from([-1, 3, 8, 16, 64]),
    max_prefill_tokens=st.sampled_from([4, 16, 64]),
    enable_prefix_caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "lpm"]),
)
request_st = st.tuples(
    st.sampled_from(range(len(PREFIXES))),
    st.lists(st.integers(1, 40), min_size=1, max_size=12),
    st.integers(1, 24),  # max_tokens
    st.booleans(),  # ignore_eos
    st.integers(0, 3),  # min_tokens
)
op_st = st.one_of(
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("add"), request_st),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


def _drive(core: EngineCore, ops: list, on_add) -> tuple[dict[str, list[int]], dict[str, str], set[str]]:
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    aborted: set[str] = set()
    n_added = 0

    def run_step() -> None:
        for d in core.step():
            assert d.request_id not in finish, "delta after finish"
            assert d.request_id not in aborted, "delta after abort"
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason is not None:
                finish[d.request_id] = d.finish_reason

    for kind, arg in ops:
        if kind == "add":
            rid, prompt, sp = on_add(n_added, arg)
            n_added += 1
            core.add_request(rid, prompt, sp)
        elif kind == "abort":
            rid = f"r{arg}"
            live = core.get_request(rid) is not None
            assert core.abort(rid) == live
            if live:
                aborted.add(rid)
        else:
            for _ in range(arg):
                run_step()
        rep = core.check_accounting()
        assert rep.ok, rep.problems
    for _ in range(2000):
        if not core.has_work():
            break
        run_step()
        assert core.check_accounting().ok
    assert not core.has_work(), "requests left unfinished"
    return outputs, finish, aborted


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=config_st, ops=st.lists(op_st, min_size=6, max_size=50))
def test_overlap_matches_reference_and_never_leaks(cfg: dict, ops: list) -> None:
    max_model_len = 32
    bs = cfg["block_size"]
    num_blocks = -(-max_model_len // bs) + cfg.pop("extra_blocks")
    config = EngineConfig(num_blocks=num_blocks, max_model_len=max_model_len, eos_token_ids={EOS}, **cfg)
    added: dict[str, tuple[list[int], SamplingParams]] = {}

    def on_add(i: int, arg: tuple) -> tuple[str, list[int], SamplingParams]:
        pre, suffix, max_tokens, ignore_eos, min_tokens = arg
        prompt = PREFIXES[pre] + suffix
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, min_tokens=min_tokens)
        added[f"r{i}"] = (prompt, sp)
        return f"r{i}", prompt, sp

    ex = LazyFakeExecutor(num_blocks, bs, vocab_size=48)  # small vocab: eos comes up now and then
    core = EngineCore(config, ex, overlap=True)
    outputs, finish, aborted = _drive(core, ops, on_add)

    stats = core.stats()
    assert stats.blocks_owned == 0 and stats.blocks_free + stats.blocks_cached == num_blocks
    assert core.scheduler.num_in_flight == 0 and not ex.queue
    for rid, (prompt, sp) in added.items():
        if rid in aborted:
            assert rid not in finish
            continue
        want, reason = reference_generation(
            ex.next_token, prompt, sp.max_tokens, max_model_len, frozenset({EOS}),
            min_tokens=sp.min_tokens, ignore_eos=sp.ignore_eos,
        )
        assert outputs[rid] == want and finish[rid] == reason, rid
        assert len(outputs[rid]) <= sp.max_tokens


def test_overlap_submits_the_next_step_before_collecting_the_previous() -> None:
    config = EngineConfig(num_blocks=64, block_size=4, max_model_len=64)
    ex = LazyFakeExecutor(64, 4)
    core = EngineCore(config, ex, overlap=True)
    core.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    outputs: list[int] = []
    while core.has_work():
        for d in core.step():
            outputs.extend(d.new_token_ids)
    want, _ = reference_generation(ex.next_token, [5, 6, 7], 4, 64)
    assert outputs == want
    # prefill (0) and three decodes (1..3); each collect comes after the next step's submit, except the last
    assert ex.calls == [("submit", 0), ("submit", 1), ("collect", 0), ("submit", 2), ("collect", 1),
                        ("submit", 3), ("collect", 2), ("collect", 3)]
    assert core.stats().num_steps == 4 and core.check_accounting().ok


def test_overlap_drops_the_step_after_an_eos_and_frees_its_block() -> None:
    # the model answers EOS at once: step 1 (planned before step 0's EOS was seen) computes a wasted decode
    config = EngineConfig(num_blocks=16, block_size=4, max_model_len=32, eos_token_ids={EOS},
                          enable_prefix_caching=False)
    ex = LazyFakeExecutor(16, 4, next_token=lambda h: EOS if len(h) >= 5 else 9)
    core = EngineCore(config, ex, overlap=True)
    core.add_request("a", [1, 2, 3, 4], SamplingParams(max_tokens=8))
    deltas = []
    while core.has_work():
        deltas.extend(core.step())
    assert [(d.new_token_ids, d.finish_reason) for d in deltas] == [((9,), None), ((EOS,), "stop")]
    assert len(ex.plans) == 3  # prefill, the decode that samples EOS, one wasted decode
    assert core.stats().blocks_free == 16
    core.add_request("b", [1], SamplingParams(max_tokens=1))
    while core.has_work():
        core.step()
    assert ex.plans[-1].finished_ids == ["a"]  # the worker is told to forget it with the next plan


def test_overlap_never_schedules_past_max_tokens() -> None:
    config = EngineConfig(num_blocks=16, block_size=4, max_model_len=32)
    ex = LazyFakeExecutor(16, 4)
    core = EngineCore(config, ex, overlap=True)
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    n = 0
    while core.has_work():
        n += sum(len(d.new_token_ids) for d in core.step())
    assert n == 3 and len(ex.plans) == 3  # known length ends are not computed one step too far
