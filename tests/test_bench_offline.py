"""`appliance bench throughput | latency` on a tiny random model: the real CLI in a subprocess (as a user runs
it), and the package's runners in process (their numbers checked against the workload they ran)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def bench(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "appliance.cli.main", "bench", *argv], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)


def test_throughput_cli(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    r = bench("throughput", "--model", str(tiny_model), "--num-prompts", "8", "--input-len", "32", "--output-len",
              "16", "--save-result", "--result-filename", str(out), "--set", "cache.max_total_tokens=2048")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Output token throughput (tok/s):" in r.stdout and "requests/s" in r.stdout
    res = json.loads(out.read_text())
    assert (res["num_requests"], res["total_input_tokens"], res["total_output_tokens"]) == (8, 256, 128)
    assert res["total_token_throughput"] == pytest.approx(384 / res["elapsed_time"])
    assert res["output_throughput"] == pytest.approx(128 / res["elapsed_time"])
    assert res["config"]["dotlist"] == ["cache.max_total_tokens=2048"]


def test_latency_cli(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "l.json"
    r = bench("latency", "--model", str(tiny_model), "--input-len", "24", "--output-len", "6", "--batch-size", "2",
              "--num-iters", "3", "--num-iters-warmup", "1", "--metric-percentiles", "50,99",
              "--output-json", str(out), "--disable-tqdm")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Avg latency:" in r.stdout and "Mean TPOT (ms):" in r.stdout and "P50 ITL (ms):" in r.stdout
    res = json.loads(out.read_text())
    assert len(res["latencies"]) == 3 and res["completed"] == 6 and res["total_output_tokens"] == 36
    assert res["avg_latency"] == pytest.approx(sum(res["latencies"]) / 3)
    assert 0 < res["mean_ttft_ms"] <= res["mean_e2el_ms"] and res["mean_tpot_ms"] > 0


def test_bad_flags_are_reported(tiny_model: Path) -> None:
    r = bench("throughput", "--model", str(tiny_model), "--num-prompts", "0")
    assert r.returncode == 2 and "--num-prompts must be >= 1" in r.stderr
    r = bench("throughput", "--preset", "qwen3-0.6b", "--load-format", "auto")
    assert r.returncode == 2 and "--load-format must be dummy" in r.stderr
    r = bench("latency", "--model", str(tiny_model), "--set", "scheduler.max_num_seqs=0")
    assert r.returncode == 2 and "max_num_seqs" in r.stderr


def test_runners_in_process(tiny_model: Path) -> None:
    from appliance import LLM
    from appliance.bench import offline
    from appliance.bench.workloads import random_workload

    llm = LLM(model=str(tiny_model), skip_tokenizer_init=True, max_total_tokens=2048, max_num_seqs=3)
    w = random_workload(llm.executor.hf_config.vocab_size, 5, (8, 16), (3, 6), seed=1)
    res = offline.throughput(llm, w)
    assert res["total_output_tokens"] == sum(w.output_lens) and res["total_input_tokens"] == w.input_tokens
    assert res["steps"] >= max(w.output_lens) and res["max_num_seqs"] == 3
    timings = offline.run_batch(llm, w.prompts[:2], 5, temperature=0.0)
    assert [t.output_tokens for t in timings] == [5, 5] and all(len(t.itl) == 4 for t in timings)
    assert all(0 < t.ttft <= t.latency for t in timings)
    with pytest.raises(ValueError, match="prompts"):
        offline.latency(llm, w, batch_size=4, num_iters=2, num_iters_warmup=0)


def test_presets_are_supported_shapes(tmp_path: Path) -> None:
    from transformers import AutoConfig

    from appliance.bench.presets import PUBLISHED, SHAPES, write_model_dir
    from appliance.models.registry import model_class

    for name in SHAPES:
        cfg = AutoConfig.from_pretrained(str(write_model_dir(name, tmp_path / name)))
        assert model_class(cfg).__name__ == SHAPES[name]["architectures"][0]
    assert {p for _, p in PUBLISHED} <= set(SHAPES)


def test_published_workload_is_the_qwen_one() -> None:
    """The Qwen3-0.6B figure's workload: 256 sequences, lengths in [100, 1024] from seed 0, drawn in order."""
    import random

    from appliance.bench.presets import PUBLISHED
    from appliance.bench.workloads import random_workload

    p = PUBLISHED[("throughput", "qwen3-0.6b")]
    w = random_workload(151936, p.num_prompts, p.input_len, p.output_len, seed=0)
    rng = random.Random(0)
    assert [len(x) for x in w.prompts] == [rng.randint(100, 1024) for _ in range(256)]
    assert w.output_lens == [rng.randint(100, 1024) for _ in range(256)]


def test_preset_with_its_published_batch_and_the_weight_floor(tmp_path: Path) -> None:
    """--preset writes the shape and runs dummy weights; flags not given come from its published workload (batch
    size 1 for latency); hf_overrides shrink the shape for a CPU."""
    out = tmp_path / "p.json"
    r = bench("latency", "--preset", "qwen3-0.6b", "--input-len", "8", "--output-len", "3", "--num-iters", "2",
              "--num-iters-warmup", "0", "--dtype", "float32", "--weight-floor", "--output-json", str(out),
              "--set", 'model.hf_overrides={"num_hidden_layers": 1, "vocab_size": 4096}',
              "--set", "model.max_model_len=64", "--set", "cache.max_total_tokens=256")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["batch_size"] == 1 and res["completed"] == 2 and res["total_output_tokens"] == 6
    # one layer of Qwen3-0.6B's width and a tied 4096-row embedding: ~19.9M float32 parameters
    assert 0.07 < res["active_weight_GB"] < 0.09 and res["floor_ms"] > 0
    assert res["tpot_over_floor"] == pytest.approx(res["mean_tpot_ms"] / res["floor_ms"])
    assert "Weight-read floor (ms):" in r.stdout
