"""tools/sim_tput.py: the modelled run accounts for every token, the roofline fit meets the measured steps, and
the ramp, partial-reservation and sum-only what-ifs do what they say. Runs in subprocesses: a what-if patches
the engine's classes for its whole process. (The finish-time check: test_admission_finish_time.py.)"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def _sim(*extra: str, blocks: int = 120) -> dict:
    args = ["--prompts", "40", "--input-len", "64", "--output-len", "32", "--num-blocks", str(blocks),
            "--max-num-seqs", "16", "--chunk", "512", *extra]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "sim_tput.py"), *args], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_the_modelled_run_accounts_for_every_token() -> None:
    out = _sim()
    assert out["preemptions"] == 0 and 0 < out["max_running"] <= 16
    # every prompt token prefilled once, every output but the first decoded once (23.9 us and 6.8 us apiece)
    assert abs(out["prefill_s"] - 40 * 64 * 23.9e-6) < 0.01 and abs(out["per_row_s"] - 40 * 31 * 6.8e-6) < 0.01
    parts = out["per_step_s"] + out["per_row_s"] + out["kv_reads_s"] + out["prefill_s"]
    assert abs(out["total_s"] - parts) < 0.03 and out["output_tok_s"] == round(40 * 32 / out["total_s"], 1)


def test_roofline_fit_reproduces_the_measured_steps() -> None:
    sys.path.insert(0, str(ROOT / "tools"))
    import sim_tput

    for p, fixed, tol_ms in ((2.5, 0.0, 0.5), (3.0, 1.0, 0.5), (2.0, 0.0, 4.0)):
        a, b = sim_tput.roofline_fit(p, fixed)
        for m, ctx, ms in sim_tput.MEASURED:
            model = fixed + (a**p + (b * m) ** p) ** (1 / p) + sim_tput.KV_NS * 1e-6 * m * ctx
            assert abs(model - ms) <= tol_ms, (p, m, model, ms)


def test_ramp_spreads_admissions_and_reserve_trades_preemptions() -> None:
    # 40 blocks of 16 tokens: the whole-output reservation holds 6 requests of 96 tokens, fewer than the 16 seats
    base, ramp = _sim(blocks=40), _sim("--what-if", "ramp:0.25", blocks=40)
    assert base["max_running"] == 6 and base["preemptions"] == 0
    # at most one admission per 4 steps: the pool fills slower, so the run takes more steps with fewer running
    assert ramp["steps"] > base["steps"] and ramp["mean_running"] < base["mean_running"]
    assert ramp["preemptions"] == 0
    over = _sim("--what-if", "reserve:0.2", blocks=40)  # a fifth of the outputs reserved: more run, some recompute
    assert over["max_running"] > base["max_running"] and over["preemptions"] > 0 and over["recomputed_tokens"] > 0


def test_sum_only_turns_the_finish_time_check_off() -> None:
    """Staggered starts (a 64-token step budget admits one 64-token prompt per step) and a pool of 120 blocks,
    5 whole requests of 64 + 256 tokens with their rounding: the finish-time check runs more at once than the sum
    alone, without a preemption, in fewer steps."""
    args = ("--input-len", "64", "--output-len", "256", "--chunk", "64")
    on, off = _sim(*args, blocks=120), _sim(*args, "--what-if", "sum-only", blocks=120)
    assert off["max_running"] == 5 < on["max_running"]
    assert on["preemptions"] == off["preemptions"] == 0 and on["steps"] < 0.9 * off["steps"]
