"""Shared by the multi-rank graph tests (test_tp_graphs.py, test_ep_graphs.py): two rank processes of one test
file, each writing a JSON report (graph keys as [batch, width])."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def finish_rank(report: dict[str, Any], out: str) -> None:
    """Write the rank's report, then leave in step with the other rank and without interpreter teardown: a rank
    whose peer (or the TCPStore host, rank 0) is already gone can hit `terminate called without an active
    exception` in a gloo thread at exit, under load (seen once in CI), failing a test whose results were fine."""
    import torch.distributed as dist

    from appliance.executor.distributed import shutdown_distributed

    Path(out).write_text(json.dumps(report, default=dataclasses.astuple))
    dist.barrier()
    shutdown_distributed()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_two_ranks(script: str, args: list[str], tmp_path: Path, timeout_s: float = 300) -> list[dict[str, Any]]:
    """Start `python script RANK PORT *args OUT` for ranks 0 and 1; each writes a JSON report to OUT."""
    from appliance.runtime.topology import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]))}
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [subprocess.Popen([sys.executable, script, str(r), str(port), *args, str(outs[r])], env=env)
             for r in range(2)]
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0, 0]
    return [json.loads(o.read_text()) for o in outs]
