"""A pipeline stage for benchmarks/host_path.py: the real scheduler and tokenizer stages, and a worker whose
runner costs a fixed time per step and computes nothing (TimedRunner), each optionally under cProfile.

    python -m benchmarks.host_path_stage NAME --step-ms 16 [--profile FILE]   (Bootstrap on stdin, as every stage)

The TimedRunner behaves as a GPU stream seen from the host: launch() returns at once with the step queued
behind the steps before it (it ends step_ms after the later of its launch and the previous step's end), its
event reports whether that end has passed, and finish() waits for it. So the worker's StepLoop, the scheduler's
overlap of planning with the step in flight and every hop keep their real timing; only the forward is gone.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.engine.step import SampledToken, StepPlan, StepResult
from appliance.runtime.bootstrap import Bootstrap

DEFAULT_KV_TOKENS = 450_000  # about what an H100 holds for Llama-3.1-8B in bf16 beside its weights


class Deadline:
    """A CUDA event's two methods over a point in time.monotonic()."""

    def __init__(self, at: float) -> None:
        self.at = at

    def query(self) -> bool:
        # the StepLoop polls this every 50 us; a nap of up to 1 ms keeps the stand-in from taking a core of the
        # host it measures (a plan arriving meanwhile is queued behind this step anyway)
        left = self.at - time.monotonic()
        if left > 0:
            time.sleep(min(left, 0.001))
        return time.monotonic() >= self.at

    def synchronize(self) -> None:
        left = self.at - time.monotonic()
        if left > 0:
            time.sleep(left)


@dataclass
class TimedHandle:
    """executor/inflight.StepHandle's fields the StepLoop reads."""

    step_id: int
    event: Deadline
    result: StepResult | None = None
    sampled_rows: list[tuple[str, int]] = field(default_factory=list)  # (request id, its length after the step)

    @property
    def done(self) -> bool:
        return False


@dataclass(frozen=True)
class KvLayout:
    window_sizes: tuple[int, ...] = ()
    window_blocks: tuple[int, ...] = ()


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]

    @classmethod
    def read(cls, model_dir: Path, max_model_len: int | None) -> ModelShape:
        cfg = json.loads((model_dir / "config.json").read_text())
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(int(cfg["vocab_size"]), int(max_model_len or cfg.get("max_position_embeddings", 4096)), eos_ids)


class TimedRunner:
    """The ModelRunnerProtocol parts a worker stage uses, with a step of a fixed duration and no compute. Each
    sampled token is a function of its request's length (never an EOS or special id), so outputs repeat."""

    num_host_blocks = num_disk_blocks = num_state_slots = state_cache_bytes = 0
    swap_costs = None
    kv_layout = KvLayout()

    def __init__(self, config: Any, step_s: float, ledger: Path | None = None) -> None:
        from appliance.config import resolve_model_path

        self.config, self.step_s, self.ledger = config, step_s, ledger
        shape = ModelShape.read(Path(resolve_model_path(config.model.path)), config.model.max_model_len)
        self.vocab_size, self.max_model_len = shape.vocab_size, shape.max_model_len
        self.eos_token_ids = list(shape.eos_token_ids)
        self.hf_config = argparse.Namespace(vocab_size=shape.vocab_size)
        self.device = "timed"
        self.block_size = config.cache.block_size
        self.num_blocks = (config.cache.max_total_tokens or DEFAULT_KV_TOKENS) // self.block_size
        self.lengths: dict[str, int] = {}  # request id -> tokens known to the worker
        self.busy_until = 0.0
        # the device's idle time between two steps that ran back to back in the engine's view (a plan that came
        # later than the step before it ended): the host path's time not hidden behind the steps
        self.num_steps, self.idle_s, self.written_at = 0, 0.0, 0.0

    def launch(self, plan: StepPlan) -> TimedHandle:
        for rid in plan.finished_ids:
            self.lengths.pop(rid, None)
        for nr in plan.new_requests:
            self.lengths[nr.request_id] = len(nr.token_ids)
        now = time.monotonic()
        if self.busy_until and now - self.busy_until < 1.0:  # longer: the engine had no work meanwhile
            self.idle_s += max(0.0, now - self.busy_until)
        start = max(now, self.busy_until)
        self.busy_until = start + self.step_s
        self.num_steps += 1
        if self.ledger is not None and now - self.written_at > 0.2:
            self.written_at = now
            part = self.ledger.with_suffix(".part")  # replaced whole: the driver may read it at any time
            part.write_text(json.dumps({"steps": self.num_steps, "idle_s": self.idle_s}))
            os.replace(part, self.ledger)
        handle = TimedHandle(plan.step_id, Deadline(self.busy_until))
        for s in plan.scheduled:
            if s.sample:
                n = self.lengths[s.request_id] = self.lengths[s.request_id] + 1
                handle.sampled_rows.append((s.request_id, n))
        return handle

    def finish(self, handle: TimedHandle) -> StepResult:
        handle.event.synchronize()
        span = self.vocab_size - 1000
        return StepResult(handle.step_id, [SampledToken(rid, 500 + (n * 7919) % span) for rid, n in handle.sampled_rows])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name")
    ap.add_argument("--step-ms", type=float, required=True)
    ap.add_argument("--profile", type=Path, default=None, help="cProfile this stage into FILE (pstats)")
    ap.add_argument("--ledger", type=Path, default=None, help="the worker's steps and idle seconds, kept in FILE")
    args = ap.parse_args()
    from appliance.runtime.stage import run_stage

    boot = Bootstrap.read(sys.stdin)
    build = (lambda b: TimedRunner(b.load_config(), args.step_ms / 1000, args.ledger)) if boot.stage == "worker" \
        else None
    if args.profile is None:
        return run_stage(boot, build)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the stop's SIGTERM ends the profile, written below
    profile = cProfile.Profile(time.thread_time)  # CPU time of the stage's thread: waits and preemption do not count
    try:
        return profile.runcall(run_stage, boot, build)
    finally:
        profile.dump_stats(args.profile)


if __name__ == "__main__":
    sys.exit(main())
