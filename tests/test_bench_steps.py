"""tools/bench_steps.py: step kinds and the per-kind sums on made-up clocks, and the --smoke run on the CPU (every
step of the last run is counted once; the GPU gives the real figures)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import load_tool

ROOT = Path(__file__).resolve().parents[1]


class FakeClock:
    def __init__(self, t: float) -> None:
        self.t = t

    def ms_until(self, later: Any) -> float:
        return later.t - self.t


def step(kind: str, start: float, end: float, launch: float = 1.0) -> dict[str, Any]:
    return {"start": FakeClock(start), "end": FakeClock(end), "kind": kind, "launch": launch, "schedule": 0.5,
            "update": 0.25, "collect": 2.0}


def test_kinds_split_decode_batches_from_eager_steps() -> None:
    tool = load_tool("bench_steps")
    assert tool.kind_of(1, 1) == "decode b<=16"
    assert tool.kind_of(17, 17) == "decode b<=64"
    assert tool.kind_of(256, 256) == "decode b<=256"
    assert tool.kind_of(300, 300) == "decode b>256"
    assert tool.kind_of(3, 515) == "mixed / prefill"


def test_by_kind_sums_spans_waits_and_host_phases() -> None:
    tool = load_tool("bench_steps")
    steps = [step("decode b<=16", 0, 4), step("decode b<=16", 5, 8, launch=3.0), step("mixed / prefill", 8, 20)]
    rows = tool.by_kind(steps)
    dec, mixed = rows["decode b<=16"], rows["mixed / prefill"]
    assert dec["steps"] == 2 and dec["span_ms"] == 7.0 and dec["span_ms_per_step"] == 3.5
    assert dec["wait_ms"] == 1.0  # 4 -> 5 idle; 8 -> 8 none
    assert dec["host_launch_ms_per_step"] == 2.0 and dec["host_collect_ms_per_step"] == 2.0
    assert mixed["steps"] == 1 and mixed["span_ms"] == 12.0 and mixed["wait_ms"] == 0.0  # the last step waits for none


def test_smoke_run_counts_every_step_once() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_steps.py"), "--smoke", "--prompts", "32"],
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    runs = [r for r in rows if "run" in r]
    kinds = [r for r in rows if "kind" in r]
    assert [r["run"] for r in runs] == [0, 1]
    # engine.step() calls: every launched step, plus the overlapped loop's last call, which only collects
    assert sum(k["steps"] for k in kinds) == runs[-1]["steps"] - 1
    assert {k["kind"] for k in kinds} >= {"mixed / prefill"}  # the prompts are prefilled eagerly
    assert all(k["span_ms"] > 0 and k["host_launch_ms_per_step"] > 0 for k in kinds)


def test_run_summary_names_the_largest_waits_and_collector_pauses() -> None:
    tool = load_tool("bench_steps")
    steps = [step("decode b<=16", 0, 4), step("mixed / prefill", 9, 20), step("decode b<=16", 21, 25)]
    out = tool.run_summary(steps, [(0, 0.5), (2, 30.0), (0, 0.25)], top=2)
    assert out["largest_waits"] == [[5.0, "mixed / prefill", 1], [1.0, "decode b<=16", 2]]
    assert out["gc"] == {"gen0": [2, 0.75], "gen2": [1, 30.0]}
    assert out["kinds"]["decode b<=16"] == [2, 8.0, 5.0]


def test_gc_pauses_records_a_collection() -> None:
    import gc

    pauses = load_tool("step_diagnostics").GcPauses()
    try:
        gc.collect(1)
        assert pauses and pauses[-1][0] == 1 and pauses[-1][1] >= 0.0
    finally:
        summary = pauses.stop()
    assert summary["gen1"][0] >= 1 and pauses.stop() == summary  # stopped: nothing more recorded
    gc.collect(1)
    assert pauses.stop() == summary


def test_gc_census_names_what_a_full_collection_walks() -> None:
    import gc

    census: list[dict[str, int]] = []
    pauses = load_tool("step_diagnostics").GcPauses(census)
    try:
        gc.collect(2)
        assert census and census[-1]["objects"] > 1000 and len(census[-1]) == 12
    finally:
        pauses.stop()


def test_step_phases_time_each_engine_call_and_restore_the_methods() -> None:
    """StepPhases wraps the engine's schedule / submit / collect / update for a block: each step's ms, the
    medians, and afterwards the classes' own methods again."""
    import time

    tool = load_tool("step_diagnostics")

    class Part:
        def schedule(self) -> int:
            return 1

        def update(self) -> None:
            return None

        def submit(self, slow: bool) -> str:
            time.sleep(0.02 if slow else 0.001)
            return "handle"

        def collect(self) -> None:
            return None

    class Engine:
        scheduler, executor = Part(), Part()

    eng = Engine()
    with tool.StepPhases(eng, stacks=True) as phases:
        for i in range(6):
            eng.scheduler.schedule()
            assert eng.executor.submit(i == 4) == "handle"
            eng.executor.collect()
            eng.scheduler.update()
    assert len(phases.steps) == 6 and phases.at(4)["submit"] >= 15.0 > phases.median()["submit"]
    assert any("submit" in " ".join(st) for _, st in phases.slow_submit_stacks())
    assert "submit" not in vars(eng.executor)  # the instance wrappers are gone
