"""The lab tools of this session's measurements on the CPU (--smoke: tiny shapes; the GPU gives the figures):
lab_ab's token comparison and A/B runs, lab_eager's per-run eager-step timings, its --forward table and its
first-run excess, lab_blas' GEMM table, lab_prefill's config check, lab_decode_chain's op and chain checks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_tool(*args: str) -> list[str]:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / args[0]), *args[1:]], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


def test_lab_ab_compares_tokens_and_rotates_the_knob_values() -> None:
    knob = "appliance.layers.attention.LONGEST_FIRST_MIN_ROWS"
    lines = run_tool("lab_ab.py", "--smoke", "--knob", f"{knob}=32,1,100000")
    result = json.loads(next(x for x in lines if x.startswith("RESULT "))[len("RESULT "):])
    assert result["equal"] == {"b1": "1/1", "b8": "8/8", "ok": True}
    rounds = [json.loads(x) for x in lines if x.startswith('{"round"')]
    names = [f"LONGEST_FIRST_MIN_ROWS={v}" for v in (32, 1, 100000)]
    assert [(r["round"], r["knob"]) for r in rounds] == [(0, n) for n in names] + [(1, n) for n in names[1:] + names[:1]]
    assert all(result["tput"][f"{n} median_tok_s"] > 0 for n in names)


def test_lab_ab_refuses_a_knob_that_does_not_exist() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "lab_ab.py"), "--smoke", "--knob",
                           "appliance.layers.attention.NO_SUCH=1,2"], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0 and "has no NO_SUCH" in proc.stderr


def test_lab_eager_times_eager_steps_and_profiles_them() -> None:
    lines = run_tool("lab_eager.py", "--smoke", "--top", "5")
    runs = [json.loads(x) for x in lines if x.startswith('{"run"')]
    assert [r["run"] for r in runs] == [0, 1] and all(r["eager_steps"] >= 1 for r in runs)
    assert any("function calls" in x for x in lines)  # the cProfile table of the last run


def test_lab_eager_first_run_excess() -> None:
    lines = run_tool("lab_eager.py", "--smoke", "--first-run", "--top", "4")
    rows = [json.loads(x) for x in lines if x.startswith('{"extra_ms"')]
    assert len(rows) == 4 and all(":" in r["function"] for r in rows)
    assert [r["extra_ms"] for r in rows] == sorted((r["extra_ms"] for r in rows), reverse=True)
    assert not any("function calls" in x for x in lines)  # the per-function diff replaces the last run's table


def test_lab_eager_forward_table() -> None:
    rows = [json.loads(x) for x in run_tool("lab_eager.py", "--smoke", "--forward") if x.startswith("{")]
    cases = [r for r in rows if "case" in r]
    assert [(r["pdl"], r["case"]) for r in cases] == [(p, c) for p in (True, False, True, False)
                                                       for c in ("prefill", "mixed")]
    assert all(len(r["same"]["host_ms"]) == 3 and len(r["new_count"]["wall_ms"]) == 3 for r in cases)


def test_lab_blas_table() -> None:
    lines = run_tool("lab_blas.py", "--smoke", "--rows", "8,16")
    rows = [json.loads(x) for x in lines if x.startswith('{"shape"')]
    assert len(rows) == 8 * 2 and all({"cublas_us", "cublaslt_us"} <= set(r) for r in rows)
    result = json.loads(next(x for x in lines if x.startswith("RESULT "))[len("RESULT "):])
    assert set(result) == {f"{m}.m{r}.{b}" for m in ("llama", "qwen") for r in (8, 16) for b in ("cublas", "cublaslt")}


def test_lab_prefill_checks_every_config_against_the_registered_one() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "lab_prefill.py"), "--smoke", "--configs",
                           "64:64:4:2,16:16:4:2,32:64:4:1"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines()]
    assert rows[0]["case"] == "smoke" and rows[0]["registered_vs_reference"] <= 2e-2
    assert [r["config"] for r in rows[1:]] == ["64:64:4:2", "16:16:4:2", "32:64:4:1"]
    assert rows[1]["err"] == 0.0 and all(r["err"] <= 2e-2 for r in rows[2:])  # bf16 outputs of order one


def test_lab_decode_chain_checks_the_fused_ops_and_the_chain() -> None:
    """On the CPU the lab checks each fused op against its reference and the fused chain against the unfused
    layers (bf16, two layers; the interpreter truncates to bf16, so errors of a few ulps); the GPU times them."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "lab_decode_chain.py"), "--smoke", "--rows", "1,3"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(x) for x in proc.stdout.splitlines()]
    ops = [r for r in rows if "op" in r]
    assert {r["op"] for r in ops} == {"norm_prep", "gemv_normed_rope_store", "gemv_normed_silu", "gemv_residual"}
    assert all(v <= 3e-2 for r in ops for k, v in r.items() if k != "op")
    chains = [r for r in rows if r.get("check")]
    assert [r["rows"] for r in chains] == [1, 3] and all(0 < r["rel"] <= 3e-2 for r in chains)
