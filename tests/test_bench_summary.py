"""benchmarks/summary.py reads the JSON that `appliance bench` writes and the peer kit's bench_vllm.py JSON, and
benchmarks/gpu_suite.sh is valid bash whose parts each name a known command."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from appliance.bench.report import RequestTiming, throughput_metrics, timing_metrics
from benchmarks.summary import table

ROOT = Path(__file__).resolve().parents[1]


def test_table_puts_ours_beside_the_peers(tmp_path: Path) -> None:
    def write(name: str, data: dict) -> None:
        (tmp_path / name).write_text(json.dumps(data))

    b1 = [RequestTiming(True, 1024, 256, ttft=0.05, latency=0.05 + 255 * 0.0055, itl=[0.0055] * 255)]
    write("b1.json", timing_metrics(b1, b1[0].latency, [99]))
    write("qwen.json", throughput_metrics(7.5, 256, 143_000, 146_340))
    write("tput8b.json", throughput_metrics(130.0, 1000, 1_024_000, 1_024_000))
    write("peer_b1.json", {"b_bs1": {"itl_ms": 6.722}})
    write("peer_qwen.json", {"c_nano": {"out_tok_s": 17324.0}})
    write("peer_8b.json", {"startup_s": 70, "a_1000": {"reqs": 1000, "out_tok_s": 7017.0}})
    serve = [RequestTiming(True, 1024, 256, ttft=0.06, latency=1.5, itl=[0.0056] * 255)] * 8
    write("serve_c1.json", timing_metrics(serve, 12.0, [50, 99]))
    write("serve_start.json", {"start_ms": 70123})
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1:] for line in table(tmp_path).splitlines()[2:]}
    assert rows["Llama-3.1-8B batch 1, 1024 in / 256 out: ms per output token"] == ["5.500", "6.722 |"]
    assert rows["Qwen3-0.6B 256 seqs, in/out U[100, 1024]: output tok/s"] == ["19,512.0", "17,324.0 |"]
    ours, peer = rows["Llama-3.1-8B N x 1024 / 1024: output tok/s"]
    assert ours.startswith("7,876.9 (1,000 prompts); - with") and peer == "7,017.0 (1000 prompts) |"
    ours, peer = rows["serving 8B 1024 / 256, concurrency 1"]
    assert ours.startswith("170.7 tok/s; TTFT 60.0 ms, TPOT 5.65 ms (p50); ITL p99 5.6 ms") and peer == "- |"
    assert rows["serving 8B 1024 / 256, concurrency 256"] == ["-", "- |"]
    assert rows["serving 8B cold start to /health 200 (ms)"] == ["70,123", "- |"]


def test_gpu_suite_is_valid_bash_and_rejects_an_unknown_part(tmp_path: Path) -> None:
    script = ROOT / "benchmarks" / "gpu_suite.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    r = subprocess.run(["bash", str(script), "nope"], capture_output=True, text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "OUT": str(tmp_path), "PYTHON": "python3",
                            "HOME": str(tmp_path)}, cwd=ROOT)
    assert r.returncode == 2 and "unknown part nope" in r.stderr and "installing" not in r.stderr
