"""tools/sim_tput.py: the modelled run accounts for every token, the roofline fit meets the measured steps, the
finish-time admission it can try admits a request the static reservation refuses, without a preemption, and the
ramp and partial-reservation what-ifs do what they say. Runs in subprocesses: the what-if patches the
engine's classes for its whole process."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCENARIO = """
import json, sys
sys.path.insert(0, "tools")
import sim_tput
from appliance.engine import EngineConfig, EngineCore, SamplingParams
head_start = int(sys.argv[2])
if sys.argv[1] == "finish-time":
    sim_tput.finish_time_admission()
cfg = EngineConfig(num_blocks=12, block_size=16, max_num_seqs=8, max_model_len=128, eos_token_ids={0},
                   schedule_conservativeness=1.0)
ex = sim_tput.CountingExecutor()
core = EngineCore(cfg, ex, overlap=False)
sp = SamplingParams(max_tokens=64, ignore_eos=True)  # 16-token prompts + 64 outputs: 5 blocks each
core.add_request("r0", list(range(1, 17)), sp)
for _ in range(head_start):  # r0 runs alone first (49 steps: its 5 blocks all held, 15 outputs left)
    core.step()
core.add_request("r1", list(range(21, 37)), sp)
core.add_request("r2", list(range(41, 57)), sp)
started = {}
step = 0
while core.has_work():
    core.step()
    step += 1
    for rid in ("r1", "r2"):
        req = core.get_request(rid)
        if rid not in started and (req is None or req.num_computed_tokens > 0):
            started[rid] = step
print(json.dumps({"started": started, "preemptions": core.stats().num_preemptions}))
"""


def _scenario(what_if: str, head_start: int = 49) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCENARIO, what_if, str(head_start)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_finish_time_admission_starts_a_request_the_static_sum_holds_back() -> None:
    static, simulated = _scenario("none"), _scenario("finish-time")
    # static: r0 (15 left) + r1 + r2 (64 each) reserve 143 tokens, and 5 spare blocks hold 80: r2 waits for r0
    assert static["started"]["r1"] == 1 and static["started"]["r2"] == 16
    # simulated: r0 frees its 5 blocks after 15 steps, before r1 and r2 outgrow the pool: both start at once
    assert simulated["started"] == {"r1": 1, "r2": 1}
    assert static["preemptions"] == simulated["preemptions"] == 0


def test_finish_time_admission_refuses_what_would_outgrow_the_pool() -> None:
    """r0 with 40 outputs left: all three would hold 13 of the 12 blocks before r0 finishes, so r2 waits."""
    simulated = _scenario("finish-time", head_start=25)
    assert simulated["started"]["r1"] == 1 and simulated["started"]["r2"] > 1
    assert simulated["preemptions"] == 0


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
