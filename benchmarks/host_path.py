"""The host path of `appliance serve` alone: the real tokenizer and scheduler processes, a worker whose step
costs a fixed time and computes nothing (benchmarks/host_path_stage.py), and `appliance bench serve` (random
prompts, ignore_eos) at each concurrency level, so everything the host spends per step that the step's time does
not hide shows as lost output tok/s against the ideal, streams x 1000 / step_ms.

Per level it prints the client's figures and each process' CPU milliseconds per engine step (from
/proc/PID/stat; the client's from its rusage); with --profile DIR the scheduler and the tokenizer stages run
under cProfile (their main thread's CPU time) and DIR gets their pstats files when the server stops.

    python -m benchmarks.host_path --step-ms 16 --levels 64:128,128:256,256:512 [--set api.stream_interval=4]

Without --model it serves the llama-3.1-8b preset's config and word-level tokenizer (appliance.bench.presets).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from appliance.config import build_config
from appliance.runtime.supervisor import Supervisor
from benchmarks.server import run_level

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Options:
    step_ms: float
    profile_dir: Path | None
    ledger: Path  # the timed worker's steps and idle seconds (host_path_stage.TimedRunner)


class TimedSupervisor(Supervisor):
    """The pipeline with every stage started by host_path_stage (the worker timed, the others under cProfile)."""

    def __init__(self, config: Any, options: Options) -> None:
        super().__init__(config, grace_period=5.0)
        self.options = options

    def stage_argv(self, kind: str, name: str) -> list[str]:
        argv = [sys.executable, "-m", "benchmarks.host_path_stage", name, "--step-ms", str(self.options.step_ms)]
        if kind == "worker":
            argv += ["--ledger", str(self.options.ledger)]
        elif self.options.profile_dir is not None:
            argv += ["--profile", str(self.options.profile_dir / f"{name}.pstats")]
        return argv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (its threads included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S


def client_cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def num_steps(base: str) -> int:
    return int(httpx.get(f"{base}/v1/internal/stats", timeout=10).json()["num_steps"])


def device_idle_s(ledger: Path) -> float:
    time.sleep(0.3)  # the worker writes its ledger every 0.2 s while it steps
    return float(json.loads(ledger.read_text())["idle_s"]) if ledger.exists() else 0.0


def run(config: Any, options: Options, levels: list[tuple[int, int]], in_len: int, out_len: int,
        tokenizer_dir: Path, work: Path) -> list[dict[str, Any]]:
    sup = TimedSupervisor(config, options)
    rows = []
    try:
        sup.start()
        base = f"http://127.0.0.1:{sup.port}"
        pids = {st.name: st.proc.pid for st in sup.stages}
        run_level(base, tokenizer_dir, 4, 4, in_len, 8, work / "warm.json", 600)  # first-use costs
        for concurrency, prompts in levels:
            cpu0, client0, steps0 = {n: cpu_seconds(p) for n, p in pids.items()}, client_cpu_seconds(), num_steps(base)
            idle0 = device_idle_s(options.ledger)
            level = run_level(base, tokenizer_dir, prompts, concurrency, in_len, out_len,
                              work / f"c{concurrency}.json", 3600)
            steps = max(1, num_steps(base) - steps0)
            idle_ms = 1000 * (device_idle_s(options.ledger) - idle0) / steps
            cpu = {n: cpu_seconds(p) - cpu0[n] for n, p in pids.items()}
            cpu["client"] = client_cpu_seconds() - client0
            ideal = concurrency * 1000 / options.step_ms
            ms_per_step = 1000 * level.get("duration", 0) / steps  # the step time the host path let through
            level.update(ideal_output_throughput=round(ideal, 1), engine_steps=steps, ms_per_step=round(ms_per_step, 2),
                         device_idle_ms_per_step=round(idle_ms, 3),
                         ratio_to_ideal=round(level.get("output_throughput", 0) / ideal, 3),
                         cpu_ms_per_step={n: round(1000 * s / steps, 3) for n, s in cpu.items()})
            rows.append(level)
    finally:
        sup.stop()
        sup.close()
    return rows


def show(rows: list[dict[str, Any]], step_ms: float) -> None:
    print(f"\nhost path, a step every {step_ms:g} ms: output tok/s (ideal, ratio) / TTFT p50 / TPOT p50 / ITL p99 ms; "
          "engine steps and their mean ms; CPU ms per engine step by process")
    for r in rows:
        cpu = ", ".join(f"{n} {v:.2f}" for n, v in r["cpu_ms_per_step"].items())
        print(f"c{r['concurrency']:<4} {r.get('output_throughput', 0):>9,.1f} ({r['ideal_output_throughput']:,.0f}, "
              f"{r['ratio_to_ideal']:.3f}) / {r.get('median_ttft_ms', 0):.1f} / {r.get('median_tpot_ms', 0):.2f} / "
              f"{r.get('p99_itl_ms', 0):.1f}; {r['engine_steps']} steps of {r['ms_per_step']:.2f} ms, the device idle "
              f"{r['device_idle_ms_per_step']:.2f} ms per step waiting for a plan; {cpu}")


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="a model dir with config.json and a tokenizer")
    ap.add_argument("--step-ms", type=float, default=16.0)
    ap.add_argument("--levels", default="64:128,128:256,256:512", help="concurrency:prompts,...")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--set", dest="dotlist", action="append", default=[], help="a config override, a.b=c")
    ap.add_argument("--profile", type=Path, default=None, help="cProfile the scheduler and tokenizer into DIR")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    levels = [tuple(int(x) for x in lv.split(":")) for lv in args.levels.split(",")]
    with tempfile.TemporaryDirectory(prefix="host-path-") as tmp:
        work = Path(tmp)
        model = args.model
        if model is None:
            from appliance.bench.presets import write_model_dir

            model = write_model_dir("llama-3.1-8b", work / "model", tokenizer=True)
        if args.profile is not None:
            args.profile.mkdir(parents=True, exist_ok=True)
        config = build_config(dotlist=[f"model.path={model}", f"api.port={free_port()}", "api.host=127.0.0.1",
                                       "api.served_model_name=bench", *args.dotlist])
        options = Options(args.step_ms, args.profile, work / "ledger.json")
        rows = run(config, options, levels, args.input_len, args.output_len, model, work)
    show(rows, args.step_ms)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
