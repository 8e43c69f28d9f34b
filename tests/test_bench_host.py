"""tools/bench_host.py runs end to end (a smoke test: its timings are never asserted)."""
from __future__ import annotations

import ast
import subprocess
import sys

import pytest
from conftest import TOOLS, load_tool

_PATH = TOOLS / "bench_host.py"


@pytest.fixture(scope="module")
def bench():
    return load_tool("bench_host")


def _run(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(_PATH), *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return ast.literal_eval(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flags", [(), ("--sync", "--prefix-caching")])
def test_bench_generates_every_requested_token(bench, flags):
    res = _run("--requests", "8", *flags)
    want = sum(out_len for _, out_len in bench.workload(8))
    assert res["steps"] > 0 and res["tokens"] == want
    assert res["us_per_token"] > 0 and res["us_per_step"] > 0


def test_workload_has_the_documented_shape(bench):
    reqs = bench.workload(50, seed=3)
    assert len(reqs) == 50 and reqs == bench.workload(50, seed=3)
    assert all(100 <= len(prompt) <= 1024 and 100 <= out_len <= 1024 for prompt, out_len in reqs)
    assert all(0 <= t < 1000 for prompt, _ in reqs for t in prompt)


def test_bench_rejects_no_requests():
    proc = subprocess.run([sys.executable, str(_PATH), "--requests", "0"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode != 0 and "--requests" in proc.stderr
