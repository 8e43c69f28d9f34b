"""tools/bench_runs.py on the CPU (--smoke: a tiny Qwen3, 4 short requests): every run reports its rate and what
it compiled, run 0's slowest steps against the later runs are listed, and RESULT summarises them (the GPU gives
the real figures)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_smoke_runs_report_rates_and_a_result() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_runs.py"), "--smoke", "--runs", "2",
                           "--layers", "1", "--step-times"], env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    runs = [json.loads(x) for x in lines if x.startswith('{"run"')]
    assert [r["run"] for r in runs] == [0, 1] and all(r["output_tok_s"] > 0 for r in runs)
    assert all(isinstance(r["compiles"], list) for r in runs)
    excess = json.loads(next(x for x in lines if x.startswith('{"steps"')))
    assert excess["steps"] > 1 and 0 < len(excess["worst_steps"]) <= 10  # the same steps in both runs
    assert excess["worst_steps"] == sorted(excess["worst_steps"], key=lambda w: -w["excess_ms"])
    result = json.loads(next(x for x in lines if x.startswith("RESULT "))[len("RESULT "):])
    assert result["runs"] == 2 and result["min"] <= result["median_tok_s"] <= result["max"]
