"""scheduler.max_mixed_prefill_tokens: every step carries every running decode, and a step that decodes takes at
most that many prefill tokens beside them, so no decode waits behind a longer prefill. A closed loop of streams
(as `appliance bench serve --max-concurrency C`) on a simulated device clock, in the synchronous and the overlap
loop: the step composition, the worst inter-token gap against the uncapped budget, the outputs (token-exact) and
the config plumbing (the server's default, the offline LLM's, -1, refusals)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import pytest

from appliance.config import build_config
from appliance.config.errors import ConfigError
from appliance.engine import EngineConfig, EngineCore, SamplingParams
from appliance.engine.config import SERVING_MIXED_PREFILL_TOKENS, mixed_prefill_tokens
from appliance.engine.fake_executor import FakeExecutor, reference_generation
from appliance.engine.step import StepPlan, StepResult

# the simulated device: a step costs a fixed part, a little per decode row and much more per prefill token
BASE_S, DECODE_ROW_S, PREFILL_TOKEN_S = 0.004, 0.0001, 0.0005
STREAMS, REQUESTS, PROMPT, OUTPUT = 24, 72, 96, 24
BUDGET, CAP = 512, 64


@dataclass(frozen=True)
class StepShape:
    decode_rows: int
    prefill_tokens: int
    missing_decodes: frozenset[str]  # running requests that could decode but are not in the step


class ClockedExecutor(FakeExecutor):
    """Runs a step when it is submitted and charges the simulated clock for it; a step's tokens are delivered at
    its end (the time of the step collected last). Records each step's shape against the decodes expected."""

    def __init__(self, core_ref: list[EngineCore], *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.core_ref = core_ref
        self.clock = 0.0
        self.expected_decodes: set[str] = set()  # set by the driver before each EngineCore.step
        self.shapes: list[StepShape] = []
        self._ends: deque[tuple[float, StepResult]] = deque()
        self.delivered_at = 0.0

    def submit(self, plan: StepPlan) -> object:
        requests = self.core_ref[0].scheduler.requests
        decode_rows = prefill = 0
        for s in plan.scheduled:
            req = requests[s.request_id]
            start = req.num_computed_tokens - s.num_tokens  # planning advanced it to the chunk's end
            if start < req.num_prompt_tokens:
                prefill += s.num_tokens
            else:
                decode_rows += 1
        ids = {s.request_id for s in plan.scheduled}
        self.shapes.append(StepShape(decode_rows, prefill, frozenset(self.expected_decodes - ids)))
        self.clock += BASE_S + DECODE_ROW_S * decode_rows + PREFILL_TOKEN_S * prefill
        self._ends.append((self.clock, super().execute(plan)))
        return plan.step_id

    def collect(self, handle: object) -> StepResult:
        self.delivered_at, result = self._ends.popleft()
        assert result.step_id == handle
        return result

    def execute(self, plan: StepPlan) -> StepResult:
        return self.collect(self.submit(plan))


@dataclass(frozen=True)
class Run:
    shapes: list[StepShape]
    outputs: dict[str, list[int]]
    worst_gap_s: float  # the longest time between two tokens of one request
    seconds: float


def closed_loop(cap: int | None, overlap: bool) -> Run:
    """STREAMS requests at a time, each finished one replaced by the next until REQUESTS have run."""
    config = EngineConfig(num_blocks=1024, block_size=16, max_num_seqs=STREAMS, chunked_prefill_size=BUDGET,
                          max_mixed_prefill_tokens=cap, max_model_len=512)
    core_ref: list[EngineCore] = []
    ex = ClockedExecutor(core_ref, config.num_blocks, config.block_size, vocab_size=1000)
    core = EngineCore(config, ex, overlap=overlap)
    core_ref.append(core)
    added = 0

    def add() -> None:
        nonlocal added
        first = 1 + 7 * added
        core.add_request(f"r{added}", [(first + i) % 997 + 1 for i in range(PROMPT)],
                         SamplingParams(max_tokens=OUTPUT, ignore_eos=True))
        added += 1

    for _ in range(STREAMS):
        add()
    outputs: dict[str, list[int]] = {}
    last: dict[str, float] = {}
    worst = 0.0
    while core.has_work():
        ex.expected_decodes = {r.request_id for r in core.scheduler.running
                               if r.num_computed_tokens >= r.num_prompt_tokens and not r.will_reach_length}
        for d in core.step():
            outputs.setdefault(d.request_id, []).extend(d.new_token_ids)
            if d.request_id in last:
                worst = max(worst, ex.delivered_at - last[d.request_id])
            last[d.request_id] = ex.delivered_at
            if d.finished and added < REQUESTS:
                add()
    assert core.check_accounting().ok
    return Run(ex.shapes, outputs, worst, ex.clock)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_mixed_steps_carry_every_decode_and_at_most_the_cap_of_prefill(overlap: bool) -> None:
    run = closed_loop(CAP, overlap)
    assert all(not s.missing_decodes for s in run.shapes), [s for s in run.shapes if s.missing_decodes][:3]
    mixed = [s for s in run.shapes if s.decode_rows and s.prefill_tokens]
    assert mixed, "the workload never mixed prefill with decodes: the test shows nothing"
    assert max(s.prefill_tokens for s in run.shapes if s.decode_rows) == CAP  # the cap is reached, never passed
    # a step without decodes takes the whole budget: the first one, STREAMS prompts waiting
    assert run.shapes[0] == StepShape(0, BUDGET, frozenset())


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_the_cap_bounds_the_inter_token_gap_at_little_cost(overlap: bool) -> None:
    capped, uncapped = closed_loop(CAP, overlap), closed_loop(None, overlap)
    assert max(s.prefill_tokens for s in uncapped.shapes if s.decode_rows) > 4 * CAP  # what the cap prevents
    # the longest a decode can wait: one step of every stream decoding beside CAP prefill tokens
    bound = BASE_S + DECODE_ROW_S * STREAMS + PREFILL_TOKEN_S * CAP
    assert capped.worst_gap_s <= bound + 1e-9 < uncapped.worst_gap_s
    # the same prefill work in more, smaller steps: the extra fixed cost per step is small beside it
    assert capped.seconds <= 1.1 * uncapped.seconds
    assert capped.outputs == uncapped.outputs  # scheduling never changes what is generated


def test_outputs_are_each_requests_own() -> None:
    run = closed_loop(CAP, overlap=True)
    ex = FakeExecutor(1, 16, vocab_size=1000)
    assert len(run.outputs) == REQUESTS
    for i in range(REQUESTS):
        first = 1 + 7 * i
        want, _ = reference_generation(ex.next_token, [(first + j) % 997 + 1 for j in range(PROMPT)], OUTPUT, 512,
                                       ignore_eos=True)
        assert run.outputs[f"r{i}"] == want


def test_unset_is_the_servers_default_and_no_bound_offline() -> None:
    sched = build_config().scheduler
    assert sched.max_mixed_prefill_tokens is None
    assert mixed_prefill_tokens(sched, serving=True) == SERVING_MIXED_PREFILL_TOKENS
    assert mixed_prefill_tokens(sched, serving=False) is None  # the offline LLM keeps its throughput path
    assert mixed_prefill_tokens(build_config(dotlist=["scheduler.max_mixed_prefill_tokens=-1"]).scheduler,
                                serving=True) is None
    assert mixed_prefill_tokens(build_config(dotlist=["scheduler.max_mixed_prefill_tokens=512"]).scheduler,
                                serving=False) == 512
    whole = build_config(dotlist=["scheduler.chunked_prefill_size=-1"]).scheduler
    assert mixed_prefill_tokens(whole, serving=True) is None  # prompts go whole: nothing to bound


@pytest.mark.parametrize("dotlist", [
    ["scheduler.max_mixed_prefill_tokens=0"],
    ["scheduler.max_mixed_prefill_tokens=-2"],
    ["scheduler.chunked_prefill_size=-1", "scheduler.max_mixed_prefill_tokens=512"],
])
def test_settings_it_cannot_honour_are_refused(dotlist: list[str]) -> None:
    with pytest.raises(ConfigError, match="max_mixed_prefill_tokens"):
        build_config(dotlist=dotlist)


def test_engine_config_refuses_a_cap_without_chunking() -> None:
    with pytest.raises(ValueError, match="max_mixed_prefill_tokens"):
        EngineConfig(num_blocks=64, chunked_prefill_size=-1, max_mixed_prefill_tokens=256)
    with pytest.raises(ValueError, match="max_mixed_prefill_tokens"):
        EngineConfig(num_blocks=64, max_mixed_prefill_tokens=0)
