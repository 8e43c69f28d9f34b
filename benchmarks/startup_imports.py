"""A stage's start-up up to serving, timed phase by phase in fresh interpreters, with what its imports cost.

Each run spawns `python -X importtime` that does what a stage does before its turn and prints its phases; the
parent reads the import-time log and sums each top-level package's own import time, so the heaviest imports and
who brought them show beside the phases. --stage worker (default): runtime/stage.py, then runtime/worker_proc.py
`build_runner` (its imports, the device and process group, the ModelRunner), STARTUP's phases
(executor/startup.py). --stage tokenizer: the stage's imports, the HTTP app's and the tokenizer
(runtime/tokenizer_proc.py `prepare_tokenizer` without the port). --stage scheduler: its imports (it builds
its engine only once the workers are ready).

    python -m benchmarks.startup_imports [--stage worker|tokenizer|scheduler] [--preset NAME] [--repeat 3]
        [--top 15] [--set KEY=VALUE ...] [--json PATH]

Default: the embedded default model on the CPU. On a GPU machine: `--preset llama-3.1-8b --set model.device=cuda`
(the preset's shape with dummy weights, appliance.bench.presets). Figures are the median of the runs.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

# the child: a worker stage's imports, then build_runner; prints {"took": {phase: s}, "total": s} as its last line
CHILD = """
import json, os, sys
spawned = float(sys.argv[1])
import appliance.runtime.stage
from appliance.executor.startup import STARTUP
from appliance.runtime import worker_proc
from appliance.runtime.addresses import Addresses
from appliance.runtime.bootstrap import Bootstrap
STARTUP.start_at(spawned)
boot = Bootstrap("worker", "worker0", 0, 1, os.getppid(), Addresses("", "", "", "", "", ("",)),
                 json.loads(sys.argv[2]), spawned_at=spawned)
runner = worker_proc.build_runner(boot)
total = STARTUP.finish()
print(json.dumps({"took": STARTUP.took, "total": total}))
"""

# the other stages' preparation, phases timed from the spawn like the worker's; same last line
PHASES = """
import json, sys, time
spawned = float(sys.argv[1])
took = {}
def lap(name):
    took[name] = time.time() - spawned - sum(took.values())
import appliance.runtime.stage
from appliance.runtime.addresses import Addresses
from appliance.runtime.bootstrap import Bootstrap
lap("process start")
config = Bootstrap("STAGE", "STAGE", 0, 1, 0, Addresses("", "", "", "", "", ("",)),
                   json.loads(sys.argv[2])).load_config()
"""
STAGE_CHILD = {
    "worker": CHILD,
    "tokenizer": PHASES.replace("STAGE", "tokenizer") + """
from appliance.runtime.tokenizer_proc import load_server_tokenizer
import appliance.server.app
lap("imports")
load_server_tokenizer(config)
lap("loading the tokenizer")
print(json.dumps({"took": took, "total": sum(took.values())}))
""",
    "scheduler": PHASES.replace("STAGE", "scheduler") + """
from appliance.runtime.scheduler_proc import run_scheduler
lap("imports")
print(json.dumps({"took": took, "total": sum(took.values())}))
""",
}

IMPORT_LINE = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)$")


def package_self_times(importtime_log: str) -> dict[str, float]:
    """Seconds of own import time per top-level package ("torch", "transformers", "appliance", ...)."""
    out: dict[str, float] = defaultdict(float)
    for line in importtime_log.splitlines():
        m = IMPORT_LINE.match(line)
        if m:
            out[m.group(4).split(".")[0]] += int(m.group(1)) / 1e6
    return dict(out)


def run_once(config: dict[str, Any], stage: str = "worker") -> tuple[dict[str, float], float, dict[str, float]]:
    """One fresh interpreter: (phase -> s, seconds from spawn to the stage prepared, package -> own import s)."""
    spawned = time.time()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", STAGE_CHILD[stage], str(spawned),
                           json.dumps(config)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the start-up failed:\n{proc.stderr[-4000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return result["took"], result["total"], package_self_times(proc.stderr)


def median_of(runs: list[dict[str, float]]) -> dict[str, float]:
    keys = list(dict.fromkeys(k for r in runs for k in r))
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=sorted(STAGE_CHILD), default="worker")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--top", type=int, default=15, help="packages listed by their own import time")
    ap.add_argument("--preset", default=None, help="a preset shape (appliance.bench.presets), dummy weights")
    ap.add_argument("--set", action="append", default=[], dest="dotlist", metavar="KEY=VALUE")
    ap.add_argument("--json", default=None, help="write the medians here")
    args = ap.parse_args(argv)
    from appliance.config import build_config

    dotlist = ["model.device=cpu"]
    if args.preset:
        from appliance.bench.presets import write_model_dir

        model_dir = write_model_dir(args.preset, Path(tempfile.mkdtemp(prefix="startup_")) / args.preset, False)
        dotlist += [f"model.path={model_dir}", "model.load_format=dummy"]
    config = build_config(dotlist=[*dotlist, *args.dotlist]).to_dict()
    phases, totals, packages = [], [], []
    for _ in range(args.repeat):
        took, total, pkgs = run_once(config, args.stage)
        phases.append(took)
        totals.append(total)
        packages.append(pkgs)
    med, pkg = median_of(phases), median_of(packages)
    done = "the runner built" if args.stage == "worker" else "its turn"
    print(f"{args.stage} start-up to {done}, median of {args.repeat}: {statistics.median(totals):.2f} s")
    for name, s in med.items():
        print(f"  {name:<45} {s:6.2f} s")
    print(f"own import time by package (top {args.top}):")
    for name, s in sorted(pkg.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"  {name:<45} {s:6.2f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_s": statistics.median(totals), "phases_s": med, "packages_s": pkg}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
