"""The engine's step timeline under the agentic sessions workload, on the CPU: `python -m tools.session_timeline`.

The EngineCore plans every step as the server would (overlap on, the server's mixed-prefill cap, the default
admission reservation), a FakeExecutor plays the workers, and a simulated clock charges each step what a modelled
GPU would take (weights read, prefill tokens, decode rows' KV reads, the host tier's block copies layer by layer
beside the forward). Sessions are closed loops as `appliance bench sessions` runs them: a shared system prompt,
each turn the history plus the answer plus a tool result, a think time between turns.

For every turn it records, in steps and simulated ms from its arrival: its admission (the plan that first carries
it), the plan that carries its host loads, and its first token; and reports the p50 by turn and the split of
turns 2-10's TTFT into waiting for admission and computing after it.
"""
from __future__ import annotations

import argparse
import heapq
import statistics
from dataclasses import dataclass, field

import numpy as np

from appliance.engine import EngineConfig, EngineCore, SamplingParams
from appliance.engine.fake_executor import FakeExecutor
from appliance.engine.host_tier import LOAD, STORE
from appliance.engine.step import StepPlan, StepResult


@dataclass(frozen=True)
class GpuModel:
    """A step's device time (ms): an 8B bf16 model on one H100, 16-token blocks of 2 MiB (128 KiB a token)."""

    base_ms: float = 6.0  # the weights read once per step
    prefill_ms_per_token: float = 0.042  # with the base: ~450 tokens in ~25 ms
    kv_read_ms_per_token: float = 4.4e-5  # a decode row reads its context: 128 KiB / 3 TB/s
    copy_ms_per_block: float = 0.084  # 2 MiB over PCIe at ~25 GB/s
    num_layers: int = 32

    def step_ms(self, plan: StepPlan, context: dict[str, int]) -> float:
        prefill = sum(s.num_tokens for s in plan.scheduled if s.num_tokens > 1)
        decode_ctx = sum(context.get(s.request_id, 0) for s in plan.scheduled if s.num_tokens == 1)
        compute = self.base_ms + prefill * self.prefill_ms_per_token + decode_ctx * self.kv_read_ms_per_token
        copies = sum(1 for d, _, _ in plan.host_copies if d in (STORE, LOAD)) * self.copy_ms_per_block
        # layer i waits for layer i's copies: the copies hide behind all but the last layer's compute
        return max(compute, copies + compute / self.num_layers)


@dataclass
class Turn:
    session: int
    turn: int
    arrival_ms: float
    prompt_len: int
    admitted_step: int = -1
    admitted_ms: float = -1.0
    loads: int = 0  # host blocks loaded at admission
    first_token_ms: float = -1.0
    first_token_step: int = -1
    steps_waited: int = 0  # plans made between its arrival and its admission


@dataclass
class Workload:
    sessions: int = 32
    turns: int = 10
    system_len: int = 2048
    user_len: int = 256
    output_len: int = 128
    tool_len: int = 320
    think_ms: float = 4000.0
    seed: int = 0
    stagger_ms: float = 0.0  # session i opens at i x this (0: all at once)


@dataclass
class Sim:
    config: EngineConfig
    gpu: GpuModel
    w: Workload
    overlap: bool = True
    now: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    steps: list = field(default_factory=list)

    def run(self) -> list[Turn]:
        w = self.w
        ex = FakeExecutor(self.config.num_blocks, self.config.block_size, vocab_size=990, verify_kv=False,
                          overlap=self.overlap)
        core = EngineCore(self.config, ex, clock=lambda: self.now / 1000.0, overlap=self.overlap)
        rng = np.random.default_rng(w.seed)
        system = rng.integers(10, 1000, w.system_len).tolist()
        history = {i: system + rng.integers(10, 1000, w.user_len).tolist() for i in range(w.sessions)}
        arrivals: list[tuple[float, int, int]] = [(i * w.stagger_ms, i, 1) for i in range(w.sessions)]
        live: dict[str, Turn] = {}
        out: dict[str, list[int]] = {}
        step = 0
        in_flight = 0.0  # the device time of the step on the device (overlap)
        while arrivals or core.has_work():
            while arrivals and arrivals[0][0] <= self.now:
                t, i, k = heapq.heappop(arrivals)
                rid = f"s{i}t{k}"
                turn = Turn(i, k, t, len(history[i]))
                live[rid] = turn
                out[rid] = []
                self.turns.append(turn)
                core.add_request(rid, history[i], SamplingParams(max_tokens=w.output_len, ignore_eos=True))
            if not core.has_work():
                self.now = arrivals[0][0]
                continue
            deltas = core.step()  # plans and submits step `step` (overlap: collects the one before)
            plan = ex.plans[-1] if ex.plans and ex.plans[-1].step_id == step else None
            context = {rid: r.num_computed_tokens for rid in live if (r := core.get_request(rid)) is not None}
            cost = self.gpu.step_ms(plan, context) if plan is not None else 0.0
            if plan is not None:
                self._admitted(plan, live, step)
                self.steps.append((step, self.now + (in_flight if self.overlap else 0.0), cost, plan))
                step += 1
            # the collected step's tokens arrive when it ends: overlap, the one on the device; else this one
            done_ms = self.now + (in_flight if self.overlap else cost)
            for d in deltas:
                turn = live[d.request_id]
                if turn.first_token_ms < 0 and d.new_token_ids:
                    turn.first_token_ms, turn.first_token_step = done_ms, step - 1 - self.overlap
                out[d.request_id].extend(d.new_token_ids)
                if d.finish_reason is not None:
                    i = turn.session
                    history[i] = history[i] + out.pop(d.request_id) + rng.integers(10, 1000, w.tool_len).tolist()
                    del live[d.request_id]
                    if turn.turn < w.turns:
                        heapq.heappush(arrivals, (done_ms + w.think_ms, i, turn.turn + 1))
            # overlap: the next plan is made when this one starts on the device, i.e. when the previous ends
            self.now = done_ms
            in_flight = cost
        for rid, turn in live.items():
            raise AssertionError(f"{rid} never finished")
        return self.turns

    def _admitted(self, plan: StepPlan, live: dict[str, Turn], step: int) -> None:
        loads = {b for d, b, _ in plan.host_copies if d == LOAD}
        for nr in plan.new_requests:
            turn = live.get(nr.request_id)
            if turn is None or turn.admitted_step >= 0:
                continue
            turn.admitted_step, turn.admitted_ms = step, self.now
            turn.loads = sum(1 for b in nr.block_ids if b in loads)
        for turn in live.values():
            if turn.admitted_step < 0:
                turn.steps_waited += 1


def report(turns: list[Turn], label: str) -> dict[str, float]:
    by_turn: dict[int, list[Turn]] = {}
    for t in turns:
        by_turn.setdefault(t.turn, []).append(t)
    p50 = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    print(f"== {label}")
    print("turn  ttft_p50  wait_p50  compute_p50  steps_waited_p50  loads_p50")
    for k in sorted(by_turn):
        ts = by_turn[k]
        print(f"{k:4d}  {p50([t.first_token_ms - t.arrival_ms for t in ts]):8.1f}  "
              f"{p50([t.admitted_ms - t.arrival_ms for t in ts]):8.1f}  "
              f"{p50([t.first_token_ms - t.admitted_ms for t in ts]):11.1f}  "
              f"{p50([t.steps_waited for t in ts]):16.1f}  {p50([t.loads for t in ts]):9.1f}")
    later = [t for t in turns if t.turn > 1]
    res = {"ttft_p50_later": p50([t.first_token_ms - t.arrival_ms for t in later]),
           "wait_p50_later": p50([t.admitted_ms - t.arrival_ms for t in later]),
           "compute_p50_later": p50([t.first_token_ms - t.admitted_ms for t in later]),
           "first_token_steps_p50_later": p50([t.first_token_step - t.admitted_step for t in later])}
    print("turns 2-10: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()))
    return res


def engine_config(pool_tokens: int, host_ratio: float, conservativeness: float, policy: str,
                  mixed: int | None, write_policy: str = "write_back") -> EngineConfig:
    blocks = pool_tokens // 16
    return EngineConfig(num_blocks=blocks, block_size=16, max_model_len=16384, chunked_prefill_size=8192,
                        max_mixed_prefill_tokens=mixed, schedule_conservativeness=conservativeness,
                        num_host_blocks=int(blocks * host_ratio), policy=policy,
                        host_cache_write_policy=write_policy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--pool-tokens", type=int, default=65536)
    ap.add_argument("--host-ratio", type=float, default=4.0, help="0: no host tier")
    ap.add_argument("--conservativeness", type=float, default=1.0)
    ap.add_argument("--policy", default="fcfs")
    ap.add_argument("--mixed", type=int, default=2048)
    ap.add_argument("--think-ms", type=float, default=4000.0)
    ap.add_argument("--stagger-ms", type=float, default=0.0)
    ap.add_argument("--copy-ms-per-block", type=float, default=GpuModel.copy_ms_per_block)
    ap.add_argument("--no-overlap", action="store_true")
    a = ap.parse_args()
    cfg = engine_config(a.pool_tokens, a.host_ratio, a.conservativeness, a.policy, a.mixed)
    w = Workload(sessions=a.sessions, turns=a.turns, think_ms=a.think_ms, stagger_ms=a.stagger_ms)
    sim = Sim(cfg, GpuModel(copy_ms_per_block=a.copy_ms_per_block), w, overlap=not a.no_overlap)
    turns = sim.run()
    report(turns, f"host ratio {a.host_ratio}, conservativeness {a.conservativeness}, policy {a.policy}")


if __name__ == "__main__":
    main()
