"""The peer (vLLM's offline LLM, load_format dummy) on exactly the workloads of benchmarks/models.py and
benchmarks/hybrid.py, with our keys, so benchmarks/summary.py puts the two side by side.

It runs under the peer kit's Python path (vLLM 0.26 in /tmp/vllm-site, gpu_suite.sh parts peer-models and
peer-hybrid): this module imports the standard library alone; vllm and torch are imported inside the functions that
measure, and appliance never. Our benchmarks write what it reads (`python -m benchmarks.models --write-configs DIR`,
`python -m benchmarks.hybrid --write-configs DIR`): each DIR/NAME/ holds config.json (the shape ours loads) and
workload.json (write_workload: the prompts' token ids, output lengths and engine limits ours runs), so both engines
run the same tokens, greedy, EOS ignored.

    python -m benchmarks.peer_models DIR [--only NAME] [--output-json OUT] [--deadline-s S]

Each model (each hybrid phase: without, then with prefix caching) runs in a process of its own: GPU memory is only
certainly back when vLLM's processes end. A model vLLM cannot load or run is a record with "error" (the end of its
log) instead of a failed run; one the time limit leaves out says so. Records, one JSON line each and a list in OUT:
- models: model, engine, settings, backend, device, cuda_graphs, kv_per_sequence, kv_pools, batch1_decode_ms_per_token,
  batch1_method, throughput (benchmarks/models.py's keys);
- hybrid: metric batch1_decode / throughput / multi_turn_ttft (snapshots false, true) with layers, device,
  gated_delta, decode_graphs (benchmarks/hybrid.py's keys); multi_turn_ttft adds ttft_method (token arrival
  times, or a one-token generate's wall time where stepping the engine fails).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORKLOAD = "workload.json"
PHASES = {"models": ("measure",), "hybrid": ("plain", "snapshots")}
# vLLM's engine settings of every run; the shape's own limits come from workload.json's "engine"
BASE_ENGINE: dict[str, Any] = {"load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16",
                               "gpu_memory_utilization": 0.9, "seed": 0}
LOG_TAIL_LINES = 6
# an exception's line, alone or behind a process's prefix: "(EngineCore pid=7) ValueError: ...", "[rank0]: ..."
EXCEPTION = re.compile(r"(?:^|[)\]]:? )((?:[A-Za-z_][\w.]*)?(?:Error|Exception|Interrupt)(?::.*)?)$")


def write_workload(model_dir: Path, spec: dict[str, Any]) -> Path:
    """model_dir/workload.json: spec["kind"] is "models" or "hybrid" (the keys each reads: measure_models /
    measure_hybrid); spec["order"] places the model among its directory's siblings."""
    if spec.get("kind") not in PHASES:
        raise ValueError(f"workload kind must be one of {sorted(PHASES)}, got {spec.get('kind')!r}")
    path = model_dir / WORKLOAD
    path.write_text(json.dumps(spec))
    return path


def model_dirs(root: Path, only: list[str] | None = None) -> list[Path]:
    """root itself when it holds a workload, else its subdirectories that do, in their specs' order."""
    if (root / WORKLOAD).is_file():
        found = [root]
    else:
        found = sorted((d for d in root.iterdir() if (d / WORKLOAD).is_file()),
                       key=lambda d: (json.loads((d / WORKLOAD).read_text()).get("order", 0), d.name))
    if only:
        missing = sorted(set(only) - {d.name for d in found})
        if missing:
            raise SystemExit(f"peer_models: no workload for {', '.join(missing)} under {root}")
        found = [d for d in found if d.name in only]
    if not found:
        raise SystemExit(f"peer_models: no {WORKLOAD} under {root} (write it with --write-configs)")
    return found


def tpot_ms(arrivals: list[float]) -> float:
    """Mean time per output token after the first (ours: (latency - ttft) / (tokens - 1))."""
    if len(arrivals) < 2:
        raise ValueError(f"a TPOT needs at least two tokens, got {len(arrivals)}")
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1e3


def error_record(model_dir: Path, phase: str, error: str, log: Path | None) -> list[dict[str, Any]]:
    """The record of a model (phase) that produced no measurement, in the keys the table reads; with the log's
    first exception (vLLM's engine processes log the root cause before the generic start-up failure) and tail."""
    spec = json.loads((model_dir / WORKLOAD).read_text())
    record: dict[str, Any] = {"model": spec.get("model", model_dir.name), "engine": "vllm", "phase": phase,
                              "error": error}
    if spec["kind"] == "hybrid":
        record["layers"] = spec["layers"]
    if log is not None:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        cause = next((m.group(1) for m in map(EXCEPTION.search, lines) if m), None)
        record.update(cause=cause, log_tail=lines[-LOG_TAIL_LINES:], log=str(log))
    return [record]


def run_child(model_dir: Path, phase: str, timeout_s: float, log_dir: Path) -> list[dict[str, Any]]:
    """One model's phase in a process of its own (its own session: a timeout ends vLLM's engine processes too)."""
    log = log_dir / f"peer_{model_dir.name}_{phase}.log"
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    cmd = [sys.executable, "-m", "benchmarks.peer_models", str(model_dir), "--child", phase, "--result", str(result)]
    rc = None
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # ended, timed out or this process stopped (SIGTERM: main): none of vLLM's processes outlives it
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    try:
        records = json.loads(result.read_text()) if rc == 0 else []
    except ValueError:
        records = []
    finally:
        result.unlink(missing_ok=True)
    if rc is None:
        return error_record(model_dir, phase, f"not finished in {timeout_s:.0f} s", log)
    return records or error_record(model_dir, phase, f"exit status {rc}", log)


def _stop(signum: int, frame: object) -> None:
    """SIGTERM (the suite's timeout) as SystemExit, so run_child's cleanup ends the model's processes."""
    raise SystemExit(128 + signum)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="a model directory with workload.json, or a folder of them")
    p.add_argument("--only", action="append", help="a model directory's name (repeatable); default: all")
    p.add_argument("--output-json", type=Path, help="every record, as one JSON list")
    p.add_argument("--deadline-s", type=float, help="time for the whole run; a model it leaves out is reported")
    p.add_argument("--log-dir", type=Path, help="the models' vLLM logs (default: the model directories)")
    p.add_argument("--child", choices=sorted({ph for phases in PHASES.values() for ph in phases}),
                   help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if (args.child is None) != (args.result is None):
        p.error("--child and --result go together")
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    args = parse_args(argv)
    if args.child is not None:
        from benchmarks.peer_measure import measure

        records = measure(args.dir, args.child)
        args.result.write_text(json.dumps(records))
        return records
    start = time.monotonic()
    records: list[dict[str, Any]] = []
    for model_dir in model_dirs(args.dir, args.only):
        kind = json.loads((model_dir / WORKLOAD).read_text())["kind"]
        for phase in PHASES[kind]:
            left = None if args.deadline_s is None else args.deadline_s - (time.monotonic() - start)
            if left is not None and left < 30:
                got = error_record(model_dir, phase, "not run: the run's time limit (--deadline-s) was spent", None)
            else:
                got = run_child(model_dir, phase, left if left is not None else 3600.0, args.log_dir or model_dir)
            for record in got:
                print(json.dumps(record), flush=True)
            records += got
            if args.output_json:  # after each model: a run cut short keeps what finished
                args.output_json.write_text(json.dumps(records, indent=1))
    return records


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _stop)
    main()
