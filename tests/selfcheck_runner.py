"""Running a kernel package's selfcheck (`python -m appliance.kernels.<pkg>.selfcheck cpu`) under Triton's CPU
interpreter, in a subprocess: TRITON_INTERPRET must be set before triton is first imported, which this test
process has already done. Shared by the Triton, MoE and MLA kernel tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def interpreted_rows(module: str, *, timeout: float, threads: int = 2) -> list[dict]:
    """The JSON rows the selfcheck printed; fails the test (with its stderr) when the selfcheck fails."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", module, "cpu"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
