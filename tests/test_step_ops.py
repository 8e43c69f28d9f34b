"""tools/step_ops.py: the launches of one decode step on the CPU (aten ops and Triton kernels under the
interpreter, in a subprocess: TRITON_INTERPRET must be set before triton is imported). A Gemma 3 layer launches
no more than a Llama layer: its four sandwich norms run as two norm_add_norm kernels and its GeGLU as one."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gemma3_layer_launches_no_more_than_llama() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-m", "tools.step_ops", "--json", "--batch", "2"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=400, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["model"]: r for r in map(json.loads, proc.stdout.splitlines())}
    gemma, llama = rows["gemma-3-12b"], rows["llama-3.1-8b"]
    ops = gemma["layer"]["ops"]
    assert ops["triton._norm_add_norm_kernel"] == 2 and ops["triton._act_and_mul_kernel"] == 1
    assert not any(op.startswith(("aten.gelu", "aten.mul", "aten.add", "triton._rms_norm")) for op in ops)
    assert gemma["layer"]["total"] == llama["layer"]["total"] == 10  # qkv, rope + store, decode + merge, o, 2 norms, gate_up, act, down
    # six layers, the embedding, its scale and the first input norm
    assert gemma["forward"]["total"] == 6 * 10 + 3
    # beyond Llama's step: the sliding groups' tables and slots, one set of ops for all five groups (each layer
    # its own group here: they share the global layer's pool), and the embedding scale
    assert gemma["step"]["total"] - gemma["forward"]["total"] == llama["step"]["total"] - llama["forward"]["total"] + 11
