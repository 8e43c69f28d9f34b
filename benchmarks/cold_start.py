"""Start to ready, three times on one machine: `appliance serve` with an empty compile cache (a fresh machine's
start), again with the cache the first start filled (a machine that has run it before), and once more with Triton's
cache emptied but the first start's list of kernel variants kept (a fresh machine given the list, as a build that
ships it: executor/compile_ahead.py). Each start is timed from the spawn to /health 200, and the worker's own
account is printed beside it: its start-up breakdown (seconds per phase, executor/startup.py), the warm-up's line
(executor/warmup.py: graphs captured, seconds per part) and the compile-ahead pool's line.

    python -m benchmarks.cold_start [--model DIR] [--out DIR] [-- SERVE ARGS...]

Default model: the Llama-3.1-8B shape with dummy bf16 weights (appliance.bench.presets, as gpu_suite.sh's serve
part). Results: a table on stdout and OUT/cold_start.json. On a CPU a tiny model dry-runs it:
`python -m benchmarks.cold_start --model DIR -- --dtype float32`.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from appliance.runtime.topology import free_port
from benchmarks.server import stop, term_with_parent, wait_healthy

DEFAULT_ARGS = ("--load-format", "dummy", "--dtype", "bfloat16")
# the worker's lines: "worker 0 start-up 71.2 s: imports 16.0 s, ..." and "warm-up: 56 decode graphs ..."
PATTERNS = {"breakdown": re.compile(r"worker \d+ (start-up [\d.]+ s: .*)$"),
            "warm_up": re.compile(r"(warm-up: .*)$"),
            "compile_ahead": re.compile(r"(compile ahead: .*)$")}
STARTS = ("cold", "warm", "listed")  # what each start finds in the compile cache (the module's docstring)


def worker_lines(log_text: str) -> dict[str, str]:
    """The first worker's start-up breakdown, warm-up and compile-ahead lines of a server log ("" where missing)."""
    found = dict.fromkeys(PATTERNS, "")
    for line in log_text.splitlines():
        for key, pattern in PATTERNS.items():
            m = pattern.search(line)
            if m and not found[key]:
                found[key] = m.group(1)
    return found


def phases(breakdown: str) -> dict[str, float]:
    """{phase: seconds} of a breakdown line ("start-up 71.2 s: imports 16.0 s, ...")."""
    _, _, rest = breakdown.partition(": ")
    out: dict[str, float] = {}
    for part in rest.split(", "):
        m = re.fullmatch(r"(.+) ([\d.]+) s", part.strip())
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def start_once(model: str, serve_args: list[str], cache_dir: Path, log_path: Path, timeout_s: float
               ) -> dict[str, Any]:
    """One `appliance serve` to /health 200 and a clean stop; its seconds and its worker's lines."""
    port = free_port()
    cmd = [sys.executable, "-m", "appliance.cli.main", "serve", model, *serve_args, "--host", "127.0.0.1",
           "--port", str(port), "--set", f"cache.compile_cache_dir={cache_dir}"]
    with log_path.open("w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=term_with_parent)  # noqa: PLW1509 (no threads yet)
        try:
            wait_healthy(proc, f"http://127.0.0.1:{port}", timeout_s)
            ready_s = round(time.monotonic() - t0, 1)
        finally:
            stopped = stop(proc, [])
    lines = worker_lines(log_path.read_text())
    return {"ready_s": ready_s, "exit_code": stopped["exit_code"], **lines, "phases": phases(lines["breakdown"])}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    serve_args = list(DEFAULT_ARGS)
    if "--" in args:
        serve_args, args = args[args.index("--") + 1:], args[: args.index("--")]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="model directory (default: the 8B shape, dummy weights)")
    p.add_argument("--out", help="results directory (default: a temporary one)")
    p.add_argument("--timeout", type=float, default=280.0, help="seconds each start may take")
    opts = p.parse_args(args)
    out = Path(opts.out or tempfile.mkdtemp(prefix="cold_start_"))
    out.mkdir(parents=True, exist_ok=True)
    model = opts.model
    if model is None:
        from appliance.bench.presets import main as write_presets

        write_presets([str(out / "models"), "--tokenizer", "--only", "llama-3.1-8b"])
        model = str(out / "models" / "llama-3.1-8b")
    cache = out / "compile_cache"
    results: dict[str, dict[str, Any]] = {}
    for name in STARTS:
        if name == "listed":  # Triton's and inductor's caches go, the kernels/ lists stay
            for sub in ("triton", "inductor"):
                shutil.rmtree(cache / sub, ignore_errors=True)
        results[name] = start_once(model, serve_args, cache, out / f"{name}_server.log", opts.timeout)
    (out / "cold_start.json").write_text(json.dumps(results, indent=2))
    for name, r in results.items():
        print(f"{name}: /health 200 after {r['ready_s']} s")
        print(f"  {r['breakdown'] or '(no breakdown line: see ' + str(out / (name + '_server.log')) + ')'}")
        print(f"  {r['warm_up'] or '(no warm-up line: decode graphs off)'}")
        if r["compile_ahead"]:
            print(f"  {r['compile_ahead']}")
    print(f"kernel lists: {sorted(p.name for p in (cache / 'kernels').glob('*.json'))} in {cache / 'kernels'}")
    print(f"results: {out / 'cold_start.json'}")
    return 0 if all(r["exit_code"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
