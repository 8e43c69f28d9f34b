"""Where a turn's TTFT goes under the agentic sessions workload, on the CPU: the engine's own step timeline.

The EngineCore plans every step as `appliance serve` would (overlap on, scheduler.max_mixed_prefill_tokens 2048,
schedule_conservativeness 1), the fake executor plays the workers, and a clock charges each step what a modelled
GPU takes (`GpuModel`: the weights read, prefill tokens, the decode rows' KV reads, the host tier's copies beside
the forward layer by layer). Sessions are closed loops as `appliance bench sessions` runs them (benchmarks/sessions.sh's
shape: 32 x 10 turns all open at once, 4 s think time, 2048-token system prompt, 256-token first message,
128-token answers, 320-token tool results, a 65,536-token pool, a host tier 4x the pool).

For every turn: the plans made between its arrival and its admission, the host blocks its admission plan loads,
and when its first token comes (steps after admission, modelled ms after arrival). Printed: the TTFT p50 by turn
with its split into waiting for admission and computing after it, the p50 over turns 2-10, and the copies the
admission plans of host hits carry (stores there delay the first tokens of that step).

    python -m benchmarks.session_timeline [--write-policy write_through] [--host-ratio 0] [--no-overlap] ...
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
from appliance.engine.step import StepPlan

BLOCK = 16


@dataclass(frozen=True)
class GpuModel:
    """A step's device time in ms: the 8B shape in bf16 on one H100, 16-token blocks of 2 MiB."""

    base_ms: float = 6.0  # the weights read once a step
    prefill_ms_per_token: float = 0.042  # with the base, ~450 tokens in ~25 ms
    kv_read_ms_per_token: float = 4.4e-5  # a decode row reads its context: 128 KiB a token at 3 TB/s
    copy_ms_per_block: float = 0.084  # 2 MiB over PCIe at ~25 GB/s
    num_layers: int = 32
    layerwise: bool = True  # the forward waits for each layer's copies (else for all of them before it starts)

    def step_ms(self, plan: StepPlan, context: dict[str, int]) -> float:
        prefill = sum(s.num_tokens for s in plan.scheduled if s.num_tokens > 1)
        decode_ctx = sum(context.get(s.request_id, 0) for s in plan.scheduled if s.num_tokens == 1)
        compute = self.base_ms + prefill * self.prefill_ms_per_token + decode_ctx * self.kv_read_ms_per_token
        copies = sum(1 for c in plan.host_copies if c[0] in (STORE, LOAD)) * self.copy_ms_per_block
        if not self.layerwise:
            return copies + compute
        # layer i waits for its own copies: they hide behind all but the last layer's compute
        return max(compute, copies + compute / self.num_layers)


@dataclass(frozen=True)
class Workload:
    sessions: int = 32
    turns: int = 10
    system_len: int = 2048
    user_len: int = 256
    output_len: int = 128
    tool_len: int = 320
    think_ms: float = 4000.0
    stagger_ms: float = 0.0  # session i opens at i x this (0: all at once)
    seed: int = 0


@dataclass
class Turn:
    session: int
    turn: int
    arrival_ms: float
    admitted_step: int = -1
    admitted_ms: float = -1.0
    loads: int = 0  # host blocks its admission plan loads
    first_token_step: int = -1
    first_token_ms: float = -1.0
    steps_waited: int = 0  # plans made between its arrival and its admission

    @property
    def ttft_ms(self) -> float:
        return self.first_token_ms - self.arrival_ms


@dataclass
class Timeline:
    config: EngineConfig
    gpu: GpuModel
    w: Workload
    overlap: bool = True
    now: float = 0.0  # modelled ms: when the next plan is made
    turns: list[Turn] = field(default_factory=list)
    plans: list[StepPlan] = field(default_factory=list)
    _live: dict[str, Turn] = field(default_factory=dict)

    def run(self) -> Timeline:
        w = self.w
        ex = FakeExecutor(self.config.num_blocks, BLOCK, vocab_size=990, verify_kv=False, overlap=self.overlap)
        core = EngineCore(self.config, ex, clock=lambda: self.now / 1000.0, overlap=self.overlap)
        rng = np.random.default_rng(w.seed)
        system = rng.integers(10, 1000, w.system_len).tolist()
        history = {i: system + rng.integers(10, 1000, w.user_len).tolist() for i in range(w.sessions)}
        arrivals = [(i * w.stagger_ms, i, 1) for i in range(w.sessions)]
        out: dict[str, list[int]] = {}
        in_flight = 0.0  # the device time of the step on the device (overlap)
        while arrivals or core.has_work():
            while arrivals and arrivals[0][0] <= self.now:
                t, i, k = heapq.heappop(arrivals)
                self._live[f"s{i}t{k}"] = turn = Turn(i, k, t)
                self.turns.append(turn)
                out[f"s{i}t{k}"] = []
                core.add_request(f"s{i}t{k}", history[i], SamplingParams(max_tokens=w.output_len, ignore_eos=True))
            if not core.has_work():
                self.now = arrivals[0][0]
                continue
            deltas = core.step()  # plans and submits a step (overlap: collects the one before)
            plan = ex.plans[-1] if len(ex.plans) > len(self.plans) else None
            cost = self._planned(plan, core) if plan is not None else 0.0
            # the collected step's tokens come when it ends: overlap, the one on the device, else this one
            done = self.now + (in_flight if self.overlap else cost)
            for d in deltas:
                turn = self._live[d.request_id]
                if turn.first_token_step < 0:
                    turn.first_token_ms, turn.first_token_step = done, len(self.plans) - 1 - self.overlap
                out[d.request_id].extend(d.new_token_ids)
                if d.finish_reason is not None:
                    del self._live[d.request_id]
                    history[turn.session] += out.pop(d.request_id) + rng.integers(10, 1000, w.tool_len).tolist()
                    if turn.turn < w.turns:
                        heapq.heappush(arrivals, (done + w.think_ms, turn.session, turn.turn + 1))
            self.now, in_flight = done, cost  # overlap: the next plan is made as this one starts on the device
        return self

    def _planned(self, plan: StepPlan, core: EngineCore) -> float:
        """Record a new plan's admissions; its modelled device time."""
        step = len(self.plans)
        self.plans.append(plan)
        loads = {c[1] for c in plan.host_copies if c[0] == LOAD}
        for nr in plan.new_requests:
            turn = self._live[nr.request_id]
            if turn.admitted_step < 0:
                turn.admitted_step, turn.admitted_ms = step, self.now
                turn.loads = sum(1 for b in nr.block_ids if b in loads)
        for turn in self._live.values():
            turn.steps_waited += turn.admitted_step < 0
        context = {rid: r.num_computed_tokens for rid in self._live if (r := core.get_request(rid)) is not None}
        return self.gpu.step_ms(plan, context)


def summary(tl: Timeline) -> dict[str, float]:
    """Turns 2 and later: TTFT p50, its wait for admission and compute after it (modelled ms), steps from admission
    to first token; the stores and loads of the plans that load host hits, per such plan."""
    later = [t for t in tl.turns if t.turn > 1]
    loading = [p for p in tl.plans if any(c[0] == LOAD for c in p.host_copies)]
    per = max(1, len(loading))
    return {"ttft_p50_ms": statistics.median(t.ttft_ms for t in later),
            "wait_p50_ms": statistics.median(t.admitted_ms - t.arrival_ms for t in later),
            "compute_p50_ms": statistics.median(t.first_token_ms - t.admitted_ms for t in later),
            "steps_to_first_token_p50": statistics.median(t.first_token_step - t.admitted_step for t in later),
            "loading_plans": len(loading),
            "stores_per_loading_plan": sum(c[0] == STORE for p in loading for c in p.host_copies) / per,
            "loads_per_loading_plan": sum(c[0] == LOAD for p in loading for c in p.host_copies) / per}


def print_turns(tl: Timeline) -> None:
    print("turn  TTFT p50  wait p50  compute p50  plans waited p50  loads p50 (blocks)")
    for k in sorted({t.turn for t in tl.turns}):
        ts = [t for t in tl.turns if t.turn == k]
        med = statistics.median
        print(f"{k:4d}  {med(t.ttft_ms for t in ts):8.1f}  {med(t.admitted_ms - t.arrival_ms for t in ts):8.1f}  "
              f"{med(t.first_token_ms - t.admitted_ms for t in ts):11.1f}  {med(t.steps_waited for t in ts):16.1f}  "
              f"{med(t.loads for t in ts):9.1f}")
    print("turns 2+: " + ", ".join(f"{k} {v:.1f}" for k, v in summary(tl).items()))


def engine_config(pool_tokens: int = 65536, host_ratio: float = 4.0, write_policy: str = "write_back",
                  mixed: int | None = 2048, conservativeness: float = 1.0, policy: str = "fcfs") -> EngineConfig:
    blocks = pool_tokens // BLOCK
    return EngineConfig(num_blocks=blocks, block_size=BLOCK, max_model_len=min(16384, pool_tokens), chunked_prefill_size=8192,
                        max_mixed_prefill_tokens=mixed, schedule_conservativeness=conservativeness, policy=policy,
                        num_host_blocks=int(blocks * host_ratio), host_cache_write_policy=write_policy)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--pool-tokens", type=int, default=65536)
    ap.add_argument("--host-ratio", type=float, default=4.0, help="0: no host tier")
    ap.add_argument("--write-policy", default="write_back", choices=("write_back", "write_through"))
    ap.add_argument("--mixed", type=int, default=2048, help="max_mixed_prefill_tokens; -1: no bound")
    ap.add_argument("--conservativeness", type=float, default=1.0)
    ap.add_argument("--policy", default="fcfs")
    ap.add_argument("--stagger-ms", type=float, default=0.0)
    ap.add_argument("--copy-ms-per-block", type=float, default=GpuModel.copy_ms_per_block)
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--copies-first", action="store_true", help="the forward waits for all its copies first")
    a = ap.parse_args()
    cfg = engine_config(a.pool_tokens, a.host_ratio, a.write_policy, None if a.mixed == -1 else a.mixed,
                        a.conservativeness, a.policy)
    w = Workload(sessions=a.sessions, turns=a.turns, stagger_ms=a.stagger_ms)
    gpu = GpuModel(copy_ms_per_block=a.copy_ms_per_block, layerwise=not a.copies_first)
    print_turns(Timeline(cfg, gpu, w, not a.no_overlap).run())


if __name__ == "__main__":
    main()
