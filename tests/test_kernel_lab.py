"""tools/kernel_lab.py on the CPU (--smoke: tiny shapes, Triton's interpreter): every section runs and every
kernel variant it would time agrees with its torch reference (timings are NaN here; the GPU gives them)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def smoke_rows(tool: str) -> list[dict]:
    """The JSON lines of `tools/<tool> --smoke` run on the CPU under Triton's interpreter (it must exit 0)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / tool), "--smoke"], env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_smoke_sections_run_and_variants_match_their_references() -> None:
    rows = smoke_rows("kernel_lab.py")
    by = {sec: [r for r in rows if r["section"] == sec]
          for sec in ("gemv", "chain_check", "chain", "decode", "done")}
    assert all(by.values()), {k: len(v) for k, v in by.items()}
    assert not [r for r in rows if "error" in r]
    checked = [r for sec in ("gemv", "chain_check", "decode") for r in by[sec] if "err" in r]
    assert len(checked) >= 10 and all(r["err"] < 1e-4 for r in checked)  # float32 in the smoke
    assert {r["impl"] for r in by["chain"]} == {"cublas", "triton", "triton+small"}
    assert {r["order"] for r in by["decode"]} == {"rows", "longest", "zigzag"}  # every row order checked


def test_lab_memory_smoke_layouts_agree() -> None:
    """tools/lab_memory.py --smoke: every section runs, and the head-major cache gives the page-major result."""
    rows = smoke_rows("lab_memory.py")
    by = {sec: [r for r in rows if r["section"] == sec] for sec in ("read", "layout")}
    assert all(by.values()), {k: len(v) for k, v in by.items()}
    checked = by["layout"]
    assert len(checked) == 2 and all(r["max_err"] == 0.0 for r in checked), checked
    assert {r["layout"] for r in by["layout"]} == {"page-major", "head-major"}
