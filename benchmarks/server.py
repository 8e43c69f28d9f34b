"""A served pipeline for the suites: `appliance run` in its own session, its /health wait, a checked stop, and
one `appliance bench serve` level against it (a subprocess, as a user runs it; its figures come back as JSON)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from appliance.runtime.process import alive

LEVEL_KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms", "p99_tpot_ms",
              "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "output_throughput", "request_throughput",
              "completed", "failed", "duration", "total_input_tokens", "total_output_tokens")


def term_with_parent() -> None:
    """preexec_fn: SIGTERM when the parent dies (Linux PR_SET_PDEATHSIG; elsewhere a no-op), so a killed suite
    leaves no server behind (the server turns SIGTERM into a clean stop)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float) -> float:
    """Seconds until GET base/health answers 200; raises if the server exits first or timeout_s passes."""
    import httpx

    t0 = time.monotonic()
    while proc.poll() is None:
        try:
            if httpx.get(f"{base}/health", timeout=2.0).status_code == 200:
                return round(time.monotonic() - t0, 1)
        except httpx.HTTPError:
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"/health not 200 within {timeout_s:.0f} s")
        time.sleep(0.5)
    raise RuntimeError(f"the server exited during start-up with {proc.returncode}")


def stop(proc: subprocess.Popen, stages: list[int]) -> dict[str, Any]:
    """SIGTERM, 30 s to drain and exit, then SIGKILL; then how many stage processes outlived it (0 expected)."""
    t = time.monotonic()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    deadline = time.monotonic() + 10  # stages exit asynchronously once their supervisor is gone
    while any(alive(p) for p in stages) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in stages if alive(p)]
    for p in left:
        os.kill(p, signal.SIGKILL)
    return {"exit_code": code, "stop_s": round(time.monotonic() - t, 1), "stages": len(stages),
            "stages_left_after_stop": len(left)}


def run_level(base: str, tokenizer_dir: Path, prompts: int, concurrency: int, in_len: int, out_len: int,
              result: Path, timeout_s: float, model: str = "bench") -> dict[str, Any]:
    """`appliance bench serve` at one max concurrency (random prompts, ignore_eos, greedy, seed 0)."""
    cmd = [sys.executable, "-m", "appliance.cli.main", "bench", "serve", "--base-url", base, "--model", model,
           "--tokenizer", str(tokenizer_dir), "--random-input-len", str(in_len), "--random-output-len",
           str(out_len), "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--ignore-eos",
           "--metric-percentiles", "50,99", "--seed", "0", "--disable-tqdm", "--result-filename", str(result)]
    proc = subprocess.run(cmd, check=False, timeout=timeout_s, capture_output=True, text=True)
    print(proc.stdout, proc.stderr[-2000:], sep="\n", flush=True)
    if not result.exists():
        return {"status": f"exit {proc.returncode}", "stderr_tail": proc.stderr[-500:]}
    m = json.loads(result.read_text())
    out = {k: (round(m[k], 3) if isinstance(m[k], float) else m[k]) for k in LEVEL_KEYS}
    out.update(concurrency=concurrency, prompts=prompts, errors=m.get("errors", []))
    return out
