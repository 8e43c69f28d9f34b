"""Random engine workloads for the property tests (a plain module the tests import, not a conftest): hypothesis
strategies for an EngineConfig and an op list (arrivals with shared prefixes, aborts, steps), a driver that runs
the ops through an EngineCore checking block accounting after each, and the check that every request that was not
aborted generated exactly what it generates alone; and the engine of the speculative-decoding tests on a fake MTP
worker."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st

from appliance.engine import EngineConfig, EngineCore, SamplingParams
from appliance.engine.fake_executor import FakeExecutor, reference_generation
from appliance.engine.request import Request
from appliance.engine.step import StepPlan, StepResult

EOS = 0
MAX_MODEL_LEN = 32
# shared prompt prefixes of the workloads (prefix cache hits); the second extends the first
PREFIXES = ([], [11, 12, 13, 14], [11, 12, 13, 14, 15, 16, 17, 18], [31, 32, 33, 34, 35, 36, 37, 38, 39])

config_st = st.builds(
    dict,
    block_size=st.sampled_from([2, 4]),
    extra_blocks=st.sampled_from([0, 0, 1, 2, 3, 6, 24]),  # mostly tiny pools: preemption
    max_num_seqs=st.integers(1, 8),
    chunked_prefill_size=st.sampled_from([-1, 3, 8, 16, 64]),
    max_prefill_tokens=st.sampled_from([4, 16, 64]),
    max_mixed_prefill_tokens=st.sampled_from([None, None, 1, 5]),  # dropped without chunking (engine_config)
    enable_prefix_caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "lpm"]),
)


def ops_st(prefixes: Sequence[list[int]]) -> st.SearchStrategy[list]:
    """Op lists: ("add", (prefix index, suffix, max_tokens, ignore_eos, min_tokens)), ("abort", i), ("step", n)."""
    request_st = st.tuples(
        st.sampled_from(range(len(prefixes))),
        st.lists(st.integers(1, 40), min_size=1, max_size=12),  # suffix (0 is eos)
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
    return st.lists(op_st, min_size=6, max_size=50)


def engine_config(cfg: dict) -> EngineConfig:
    """The drawn config with a pool from "one sequence fits" upwards (cfg's extra_blocks is consumed)."""
    num_blocks = -(-MAX_MODEL_LEN // cfg["block_size"]) + cfg.pop("extra_blocks")
    if cfg["chunked_prefill_size"] == -1:
        cfg["max_mixed_prefill_tokens"] = None  # bounds chunks beside decodes: chunking only
    return EngineConfig(num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN, eos_token_ids={EOS}, **cfg)


@dataclass(frozen=True)
class Outcome:
    added: dict[str, tuple[list[int], SamplingParams]]
    outputs: dict[str, list[int]]
    finish: dict[str, str]
    aborted: set[str]


def drive(core: EngineCore, ops: list, prefixes: Sequence[list[int]]) -> Outcome:
    """Runs the ops, then steps until no work is left; the accounting holds after every op and every step."""
    added: dict[str, tuple[list[int], SamplingParams]] = {}
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    aborted: set[str] = set()

    def run_step() -> None:
        for d in core.step():
            assert d.request_id not in finish, "delta after finish"
            assert d.request_id not in aborted, "delta after abort"
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.finish_reason is not None:
                finish[d.request_id] = d.finish_reason

    for kind, arg in ops:
        if kind == "add":
            pre, suffix, max_tokens, ignore_eos, min_tokens = arg
            rid = f"r{len(added)}"
            prompt = prefixes[pre] + suffix
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos, min_tokens=min_tokens)
            core.add_request(rid, prompt, sp)
            added[rid] = (prompt, sp)
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
    return Outcome(added, outputs, finish, aborted)


def assert_each_generates_what_it_generates_alone(ex: FakeExecutor, run: Outcome) -> None:
    for rid, (prompt, sp) in run.added.items():
        if rid in run.aborted:
            assert rid not in run.finish
            continue
        want, reason = reference_generation(
            ex.next_token, prompt, sp.max_tokens, MAX_MODEL_LEN, frozenset({EOS}),
            min_tokens=sp.min_tokens, ignore_eos=sp.ignore_eos,
        )
        assert run.outputs[rid] == want and run.finish[rid] == reason, rid
        assert len(run.outputs[rid]) <= sp.max_tokens


def make_request(rid: str, prompt: int, max_tokens: int | None, generated: int = 0, ignore_eos: bool = False,
                 max_model_len: int = 1 << 20) -> Request:
    """A request of `prompt` tokens (1..prompt) that has generated `generated` tokens (7 each): for admission
    arithmetic, outside any scheduler."""
    r = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos), 0.0,
                max_model_len=max_model_len)
    r.output_token_ids = [7] * generated
    return r


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


def spec_engine(k: int, quality: Callable[[str, int], int] | None = None,
                count: Callable[[str, int], int] | None = None, overlap: bool = False,
                **cfg: Any) -> tuple[EngineCore, FakeExecutor]:
    """An EngineCore verifying k drafts a step on a FakeExecutor playing an MTP worker (`quality`: how many of a
    request's drafts are right; `count`: how many it proposes); overlap: one step in flight, the worker a
    LazyFakeExecutor. `cfg` overrides the EngineConfig (64 blocks of 4, MAX_MODEL_LEN, EOS)."""
    config = EngineConfig(**{"num_blocks": 64, "block_size": 4, "max_model_len": MAX_MODEL_LEN,
                             "eos_token_ids": {EOS}, "num_speculative_tokens": k, **cfg})
    worker = LazyFakeExecutor if overlap else FakeExecutor
    ex = worker(config.num_blocks, config.block_size, vocab_size=48, num_speculative_tokens=k,
                max_model_len=config.max_model_len, draft_quality=quality, overlap=overlap, draft_count=count)
    return EngineCore(config, ex, overlap=overlap), ex
