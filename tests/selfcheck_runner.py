"""Running a kernel package's selfcheck (`python -m appliance.kernels.<pkg>.selfcheck cpu`) under Triton's CPU
interpreter, in a subprocess: TRITON_INTERPRET must be set before triton is first imported, which this test
process has already done. Shared by the Triton, MoE and MLA kernel tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def interpreted_rows(module: str, *, timeout: float, threads: int = 2) -> list[dict]:
    """The JSON rows the selfcheck printed; fails the test (with its stderr) when the selfcheck fails."""
    return _interpreted(["-m", module, "cpu"], timeout=timeout, threads=threads)


def interpreted_script_rows(code: str, *, timeout: float, threads: int = 2) -> list[dict]:
    """The same for a script (`python -c code`) that may import the test modules (tests/ is on its path)."""
    return _interpreted(["-c", code], timeout=timeout, threads=threads, extra_path=str(ROOT / "tests"))


def _interpreted(args: list[str], *, timeout: float, threads: int, extra_path: str | None = None) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), extra_path, env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def interpreted_cases(module: str, *, timeout: float, threads: int = 2) -> dict[str, dict]:
    """interpreted_rows keyed by their "case"."""
    return {r["case"]: r for r in interpreted_rows(module, timeout=timeout, threads=threads)}


def print_case_rows(cases: dict[str, Any], run_case: Callable[[Any, str], dict[str, Any]]) -> None:
    """A test module run as a script under TRITON_INTERPRET=1 (interpreted_rows): one JSON row per case, on the
    CPU; a case that raises prints its error instead, so it cannot hide the others."""
    import appliance.kernels.triton  # noqa: F401  (registers the ops)

    for name, spec in cases.items():
        try:
            print(json.dumps({"case": name, **run_case(spec, "cpu")}), flush=True)
        except Exception as exc:  # noqa: BLE001
            print(json.dumps({"case": name, "error": f"{type(exc).__name__}: {exc}"}), flush=True)
