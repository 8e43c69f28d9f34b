"""tools/bench_gpu.py's serving and hf sections, without a GPU: the word-level tokenizer the serving section gives
the 8B shape, the report rows and speed-up ratios, the process-group stop of a timed-out section, and the flag
checks, and the serving section end to end on the CPU. (All sections run end to end with `python
tools/bench_gpu.py --smoke`.)"""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from appliance.runtime.process import alive

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

bench_gpu = importlib.import_module("bench_gpu")
serving = importlib.import_module("gpu_sections_serving")
hf = importlib.import_module("gpu_sections_hf")
measure = importlib.import_module("gpu_measure")


def test_word_tokenizer_covers_the_vocabulary_and_round_trips(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    serving.write_word_tokenizer(tmp_path, 500, bos=400, eos=401)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert len(tok) == 500
    assert (tok.bos_token_id, tok.eos_token_id) == (400, 401)
    assert {400, 401, tok.unk_token_id} == set(tok.all_special_ids) and tok.unk_token_id not in (400, 401)
    ids = [499, 3, 250, 3, 17]  # any id, repeats included: decode then encode gives the same ids back
    text = tok.decode(ids)
    assert text == "w499 w3 w250 w3 w17"
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.decode([7]) == "w7"  # every id has text: streamed chunks are never empty


def test_word_tokenizer_rejects_a_bad_shape(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bad tokenizer shape"):
        serving.write_word_tokenizer(tmp_path, 100, bos=100, eos=1)
    with pytest.raises(ValueError, match="bad tokenizer shape"):
        serving.write_word_tokenizer(tmp_path, 100, bos=5, eos=5)


def test_bench_serving_random_prompts_have_exact_lengths_with_it(tmp_path: Path) -> None:
    import bench_serving
    from transformers import AutoTokenizer

    serving.write_word_tokenizer(tmp_path, 300, bos=1, eos=2)
    reqs = bench_serving.random_requests(4, 50, 7, 0.0, 0, AutoTokenizer.from_pretrained(str(tmp_path)), seed=0)
    assert [r.prompt_len for r in reqs] == [50] * 4 and all(len(r.prompt.split()) == 50 for r in reqs)


def _level(c: int, **over: Any) -> dict[str, Any]:
    lv = {f"{s}_{m}_ms": float(c + i) for i, s in enumerate(("mean", "median", "p99"))
          for m in ("ttft", "tpot", "itl")}
    lv.update(concurrency=c, prompts=2 * c, output_throughput=100.0 * c, failed=0)
    lv.update(over)
    return lv


def test_serving_rows_give_every_level_and_its_latencies() -> None:
    sec = {"workload": {"in": 1024, "out": 256}, "server_start_s": 50.0,
           "server": {"stop": {"stages_left_after_stop": 0}},
           "levels": [_level(1), _level(16, failed=3), {"concurrency": 64, "prompts": 192, "status": "timed out"}]}
    rows = serving.table_rows(sec)
    text = "\n".join(" | ".join(r) for r in rows)
    assert rows[0][1] == "50.0 s / 0"
    assert "concurrency 1 (2 prompts): output tok/s | 100.0" in text
    assert "concurrency 16 (32 prompts): output tok/s, 3 FAILED | 1600.0" in text
    assert "TTFT ms mean / p50 / p99 | 16.0 / 17.0 / 18.0" in text
    assert "concurrency 64 (192 prompts) | timed out" in text
    assert serving.table_rows({}) == []
    assert serving.table_rows({"status": "exit 1"})[0][1] == "exit 1"


def test_speedups_need_both_sides_of_the_same_run() -> None:
    hf_res = {"llama_b1": {"tpot_ms": 40.0}, "qwen_subset": {"output_tok_s": 500.0}}
    llama, qwen = {"b1_graphs": {"tpot_ms": 8.0}}, {"tput_graphs": {"output_tok_s": 12500.0}}
    assert hf.ratios(hf_res, llama, qwen) == {"b1_ms_per_token": 5.0, "qwen_tok_s": 25.0}
    assert hf.ratios(hf_res, {}, {"tput_graphs": "skipped (section budget)"}) == \
        {"b1_ms_per_token": None, "qwen_tok_s": None}
    rows = hf.table_rows({**hf_res, "transformers": "5.17.0"}, llama, qwen)
    assert rows[0][2] == "appliance = 5.0x its speed" and rows[1][2] == "appliance = 25.0x its speed"
    assert hf.table_rows({"qwen_subset": "skipped (9 s left)"}, {}, {})[1][1] == "skipped (9 s left)"


def test_a_timed_out_sections_group_is_ended_children_included() -> None:
    # a "section" that ignores SIGTERM for a while and has a child in its group: both must be gone afterwards
    code = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, lambda *a: None); "
            "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(c.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True, stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    t = time.monotonic()
    bench_gpu._end_group(proc, grace_s=2.0)
    assert proc.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    assert not alive(child)
    assert time.monotonic() - t < 20


def test_serving_flags_must_pair_up() -> None:
    assert serving.parse_levels("8,64,192", "1,16,64") == [(8, 1), (64, 16), (192, 64)]
    for prompts, conc in (("8,64", "1,16,64"), ("8,0", "1,2"), ("8,x", "1,2"), ("", "1")):
        with pytest.raises(SystemExit, match="one positive count per level"):
            serving.parse_levels(prompts, conc)


def test_unknown_sections_are_refused() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--only", "copy,servng"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown sections ['servng']" in proc.stderr


def test_serving_section_runs_end_to_end_with_the_synchronous_loop(tmp_path: Path) -> None:
    """The real section on the CPU (tiny shapes): server up, three levels measured, server stopped with no stage
    left; --no-overlap reaches the server's command line."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--smoke", "--quick", "--only", "serving",
                           "--no-overlap", "--serving-prompts", "2,4,4", "--serving-concurrency", "1,2,4",
                           "--budget-s", "240", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    sec = json.loads(out.read_text())["serving"]
    assert sec["status"] == "ok", proc.stdout[-2000:]
    assert "--enable-overlap-schedule false" in sec["server"]["command"]
    assert [lv["concurrency"] for lv in sec["levels"]] == [1, 2, 4]
    assert all(lv["completed"] == lv["prompts"] for lv in sec["levels"])
    assert sec["server"]["stop"]["stages_left_after_stop"] == 0


def test_run_profile_section_takes_the_llama_workload(tmp_path: Path) -> None:
    """run_profile with --profile-preset llama-3.1-8b on the CPU (tiny shapes): the 8B throughput workload's
    prompts (--tput-prompts, scaled like the other smoke workloads), a plain run, and the gap histogram's buckets
    (empty here: the CPU profiler records no device activity)."""
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--smoke", "--quick", "--only",
                           "run_profile", "--profile-preset", "llama-3.1-8b", "--tput-prompts", "32",
                           "--budget-s", "200", "--json", str(out)], capture_output=True, text=True, timeout=260)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    sec = json.loads(out.read_text())["run_profile"]
    assert sec["status"] == "ok" and sec["workload"] == "llama-3.1-8b: 2 prompts"
    assert sec["plain"]["output_tokens"] == 2 * 64 and sec["plain"]["preemptions"] == 0
    assert set(sec["idle_gaps_profiled"]) == {"0-2 us", "2-10 us", "10-100 us", ">= 100 us"}


def test_llama_sections_run_the_8b_recipes_step_budget(tmp_path: Path) -> None:
    """The 8B runs as recipes/llama-3.1-8b.toml deploys it (its step budget, read as the config loader reads
    it), or with the engine default under --engine-default-budget; the section records which."""
    from appliance.config.loader import build_config
    from appliance.config.recipes import recipe_path

    want = build_config(recipe_path("llama-3.1-8b"), env={}).scheduler.chunked_prefill_size
    assert measure.recipe_step_budget("llama-3.1-8b") == want
    for extra, expect in (([], want), (["--engine-default-budget"], "engine default")):
        out = tmp_path / f"bench{len(extra)}.json"
        proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_gpu.py"), "--smoke", "--only",
                               "llama_tput", "--tput-prompts", "32", "--budget-s", "200", "--json", str(out),
                               *extra], capture_output=True, text=True, timeout=260)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        sec = json.loads(out.read_text())["llama_tput"]
        assert sec["status"] == "ok" and sec["chunked_prefill_size"] == expect
        assert sec["tput_graphs"]["output_tokens"] == 32 * 64  # smoke: 64 output tokens each
