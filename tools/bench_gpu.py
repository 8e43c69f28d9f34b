#!/usr/bin/env python3
"""The GPU-speed benchmark of issue 6: CUDA-graph correctness, the target workloads, serving, transformers; one table.

    python3 tools/bench_gpu.py [--quick] [--only SECTIONS] [--no-overlap] [--budget-s 430] [--json PATH]

How to run (device root, `.whl` carried, see tools/device_wheels.sh; each line one ~10-minute device call, each
command preceded by the install line `python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
--upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=8 PYTHONUNBUFFERED=1`):
    python3 tools/bench_gpu.py --only copy,tiny,qwen,llama,hf --quick --budget-s 560   # b1 ms/token + floor, Qwen
                                                      # tok/s, graphs == eager, transformers (8B tput: 256 prompts)
    python3 tools/bench_gpu.py --only llama_tput --budget-s 560                          # 8B 1000 x 1024/1024
    python3 tools/bench_gpu.py --only serving,profile --budget-s 400                     # serving at 1/16/64
Each writes $OUT/bench_gpu.json (and profile.txt / run_profile.txt / host_profile.txt / serving_server.log beside
it); the table ends each output.
--smoke runs every section with tiny shapes on any device (this CPU included): it checks the script, not speed.

Models run as the product does by default, with overlap scheduling (step N+1 planned while step N runs);
--no-overlap runs them with the synchronous loop instead (compare the two tables).

Sections run in subprocesses, each in its own process group (a crash or a time-out loses one section, and the
time-out signal reaches the section's children too, e.g. the serving section's server; each model's memory is
freed):
  copy     device-to-device copy bandwidth (bytes read + written), for the weight-read floor
  tiny     greedy tokens with CUDA graphs == eager on a tiny random Llama (realistic-scale random weights)
  qwen     the same check on qwen3-0.6b (dummy weights), then 256 seqs, in/out uniform [100, 1024], seed 0:
           output tok/s with graphs and (budget allowing) eager
  llama    Llama-3.1-8B (dummy): batch 1, 1024 in / 256 out, mean time per output token (graphs and eager, and
           the weight-read floor = weight bytes read per step / copy bandwidth); then N x 1024 in / 1024 out,
           ignore_eos, output tok/s (N = 1000, or --tput-prompts; --quick uses 256 and the table says so). With
           the step budget of recipes/llama-3.1-8b.toml (scheduler.chunked_prefill_size), as the 8B ships;
           --engine-default-budget: the engine default
  llama_tput  the llama section without its batch-1 part: N x 1024/1024 only (N = 1000 unless --tput-prompts)
  profile  torch.profiler over 20 decode steps of --profile-batch (256) running --profile-preset requests
           (profile.txt)
  run_profile  the qwen workload whole under torch.profiler: device seconds per kernel category, GPU idle share
           and its gaps by length, its kernel table in run_profile.txt; --profile-preset llama-3.1-8b: --tput-prompts
           (256) x 1024/1024 instead
  serving  `appliance serve` (Llama-3.1-8B, dummy) + tools/bench_serving.py, random 1024/256, ignore_eos, at max
           concurrency --serving-concurrency (1,16,64) with --serving-prompts (8,64,192): TTFT / TPOT / ITL
           mean, p50, p99 and output tok/s per level (tools/gpu_sections_serving.py)
  hf       transformers' generate_batch on the same GPU: Llama-3.1-8B b1 ms per token (--hf-out tokens) and
           Qwen3-0.6B tok/s on --hf-seqs sequences of the qwen workload; the table gives the speed-up
           appliance / transformers from this run's llama and qwen sections (tools/gpu_sections_hf.py)
Sampling as in `vllm bench`: temperature 1.0, top_p 1.0, ignore_eos (serving: bench_serving's default, greedy).
Each section writes its JSON as it goes, so a section cut by its time limit still reports what it measured.
JSON: --json, or $OUT/bench_gpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

import gpu_measure
import gpu_sections_hf
import gpu_sections_profile
import gpu_sections_serving
from gpu_measure import (
    TINY,
    Recorder,
    _gemv_ms,
    _greedy_equal,
    _llm,
    _replay_ms,
    _throughput,
    _tpot,
    _weight_bytes,
    llama_workload,
    qwen_workload,
    recipe_step_budget,
)

SECTION_CAPS = {"copy": 60, "tiny": 90, "qwen": 170, "llama": 300, "llama_tput": 480, "profile": 120,
                "run_profile": 150, "serving": 240, "hf": 120}
GROWS = ("llama", "llama_tput", "run_profile")  # sections that take whatever budget is left beyond their cap
# (run_profile: the 8B preset runs its workload three times, which its Qwen3-sized cap cut off in session 7)


def section_copy(rec: Recorder, args: argparse.Namespace) -> None:
    import torch

    n = 1 << (20 if args.smoke else 30)  # 1 GiB per buffer
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.randn(n // 2, dtype=torch.bfloat16, device=dev)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    times = []
    for _ in range(20):
        if dev == "cpu":
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    rec["device"] = torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)"
    rec["torch"] = torch.__version__
    rec["copy_GBps"] = round(2 * n / statistics.median(times) / 1e9, 1)


def section_tiny(rec: Recorder, args: argparse.Namespace) -> None:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        llm = _llm(TINY, Path(tmp), enable_prefix_caching=False, max_num_seqs=16)
    model = llm.executor.runner.model
    gen = torch.Generator(device=llm.executor.runner.device).manual_seed(1)
    with torch.no_grad():  # realistic-scale weights: logits far from ties, so any numeric drift would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.05, generator=gen)
    rng = random.Random(0)
    k = 8 if args.smoke else 1
    rec["tiny_b8"] = _greedy_equal(llm, rng, TINY["vocab_size"], 48 // k,
                                   [rng.randint(5, 300 // k) for _ in range(8)])
    rec["tiny_b13_padded"] = _greedy_equal(llm, rng, TINY["vocab_size"], 32 // k,
                                           [rng.randint(5, 700 // k) for _ in range(13)])


def section_qwen(rec: Recorder, args: argparse.Namespace) -> None:
    from bench_offline import PRESETS

    cfg = TINY if args.smoke else PRESETS["qwen3-0.6b"]
    k = 16 if args.smoke else 1
    deadline = time.monotonic() + args.section_budget
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        llm = _llm(cfg, Path(tmp), enable_prefix_caching=False)
        rec["init_s"] = round(time.perf_counter() - t, 1)
    rec["runner_warmup_s"] = round(llm.executor.runner.warmup_s, 1)
    rng = random.Random(1)
    rec["greedy_b8_graphs_vs_eager"] = _greedy_equal(llm, rng, cfg["vocab_size"], 32,
                                                     [rng.randint(16, 600 // k) for _ in range(8)])
    t = time.perf_counter()
    rec["graphs_captured_upfront"] = llm.executor.runner.capture_graphs(2048)
    rec["capture_s"] = round(time.perf_counter() - t, 1)
    ids, out_lens = qwen_workload(cfg["vocab_size"], 256 // k, k)
    prompts = [{"prompt_token_ids": p} for p in ids]
    warm = _throughput(llm, prompts[:16], [8] * 16)  # compiles any kernel variant not met yet
    rec["warmup_s"] = warm["elapsed_s"]
    g = _throughput(llm, prompts, out_lens)
    rec["tput_graphs"] = g
    if time.monotonic() + 3 * g["elapsed_s"] + 10 < deadline:
        llm.executor.runner.use_graphs = False
        rec["tput_eager"] = _throughput(llm, prompts, out_lens)
    else:
        rec["tput_eager"] = "skipped (section budget)"


def section_llama(rec: Recorder, args: argparse.Namespace, b1: bool = True) -> None:
    from bench_offline import PRESETS

    cfg = TINY if args.smoke else PRESETS["llama-3.1-8b"]
    k = 16 if args.smoke else 1
    deadline = time.monotonic() + args.section_budget
    budget = {} if args.engine_default_budget else {"chunked_prefill_size": recipe_step_budget("llama-3.1-8b")}
    rec["chunked_prefill_size"] = budget.get("chunked_prefill_size", "engine default")
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        llm = _llm(cfg, Path(tmp), **budget)
        rec["init_s"] = round(time.perf_counter() - t, 1)
    rec["runner_warmup_s"] = round(llm.executor.runner.warmup_s, 1)
    runner = llm.executor.runner
    rec["num_kv_blocks"] = runner.num_blocks
    rec["weight_bytes_per_step"] = _weight_bytes(runner.model)
    t = time.perf_counter()
    rec["graphs_captured_upfront"] = runner.capture_graphs(2048)
    rec["capture_s"] = round(time.perf_counter() - t, 1)
    vocab = cfg["vocab_size"]
    if b1:
        _llama_b1(rec, llm, vocab, k)
    runner.use_graphs = True
    n = args.tput_prompts or (256 if args.quick and b1 else 1000) // k
    rec["tput_prompts"] = n
    left = deadline - time.monotonic()
    if left < 45:
        rec["tput_graphs"] = f"skipped ({left:.0f} s left)"
        return
    # fewer prompts when the budget is short (assumes >= 4,000 tok/s; the table names the count)
    n = max(16, min(n, int((left - 25) * 4000 / (1024 // k) / 1.3)))
    rec["tput_prompts"] = n
    rec["tput_graphs"] = _throughput(llm, *llama_workload(vocab, n, k))


def _llama_b1(rec: Recorder, llm: Any, vocab: int, k: int) -> None:
    """Batch 1, 1024 in / 256 out: ms per output token with graphs and eager, graph replay and GEMV times."""
    runner = llm.executor.runner
    rng = random.Random(2)
    _tpot(llm, [rng.randrange(vocab) for _ in range(1024 // k)], 8)  # warm-up
    for mode in ("graphs", "eager"):
        runner.use_graphs = mode == "graphs"
        runs = [_tpot(llm, [rng.randrange(vocab) for _ in range(1024 // k)], 256 // k) for _ in range(3)]
        rec[f"b1_{mode}"] = {"tpot_ms": round(statistics.median(r["tpot_ms"] for r in runs), 3),
                             "ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs), 2), "runs": runs}
    rec["b1_graph_replay_ms"] = _replay_ms(runner)
    rec["b1_gemv_ms"] = _gemv_ms(runner.model)


def section_llama_tput(rec: Recorder, args: argparse.Namespace) -> None:
    """The 8B throughput run alone (its own device call for the full 1000 prompts)."""
    section_llama(rec, args, b1=False)


SECTIONS = {"copy": section_copy, "tiny": section_tiny, "qwen": section_qwen, "llama": section_llama,
            "llama_tput": section_llama_tput, "profile": gpu_sections_profile.section_profile,
            "run_profile": gpu_sections_profile.section_run_profile,
            "serving": gpu_sections_serving.section_serving, "hf": gpu_sections_hf.section_hf}


# ---- driver --------------------------------------------------------------------------------------------------
def _run_section(name: str, args: argparse.Namespace, budget: float, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{name}.json"
    cmd = [sys.executable, __file__, "--section", name, "--section-json", str(out), "--section-budget",
           str(max(budget - 15, 10)), "--tput-prompts", str(args.tput_prompts), "--serving-prompts",
           args.serving_prompts, "--serving-concurrency", args.serving_concurrency, "--hf-out", str(args.hf_out),
           "--hf-seqs", str(args.hf_seqs), "--profile-preset", args.profile_preset, "--profile-prompt",
           str(args.profile_prompt), "--profile-batch", str(args.profile_batch)] + \
          (["--quick"] if args.quick else []) + \
          (["--smoke"] if args.smoke else []) + (["--no-overlap"] if args.no_overlap else []) + \
          (["--engine-default-budget"] if args.engine_default_budget else [])
    print(f"== {name} (limit {budget:.0f} s)", flush=True)
    t = time.perf_counter()
    # its own process group: a time-out reaches everything the section started (the serving section's server);
    # and it gets SIGTERM if this driver dies (killed from outside), so nothing outlives the run on the box
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
                            preexec_fn=gpu_sections_serving.term_with_parent)  # noqa: PLW1509 (no threads here)
    try:
        code = proc.wait(timeout=budget)
        status = "ok" if code == 0 else f"exit {code}"
    except subprocess.TimeoutExpired:
        status = "timed out"
        _end_group(proc)
    except BaseException:  # the driver is being stopped (SIGTERM, Ctrl-C): stop the section with it
        _end_group(proc, grace_s=10.0)
        raise
    data = json.loads(out.read_text()) if out.exists() else {}
    data["status"], data["wall_s"] = status, round(time.perf_counter() - t, 1)
    return data


def _end_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM to the section's process group (a server there drains and stops), grace_s, then SIGKILL to it."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            deadline = time.monotonic() + wait_s  # the group's other members may still be exiting
            while time.monotonic() < deadline:
                os.killpg(proc.pid, 0)
                time.sleep(0.2)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            pass


def _fmt(v: Any, key: str) -> str:
    return str(v.get(key, "-")) if isinstance(v, dict) else str(v if v is not None else "-")


def table(res: dict[str, dict[str, Any]]) -> str:
    copy, tiny, qwen, llama = (res.get(k, {}) for k in ("copy", "tiny", "qwen", "llama"))
    bw = copy.get("copy_GBps")
    wbytes = llama.get("weight_bytes_per_step")
    floor = wbytes / (bw * 1e9) * 1e3 if bw and wbytes else None
    rows = [("device", copy.get("device", "-"), "", ""),
            ("copy bandwidth (read + write)", f"{bw} GB/s", "", ""),
            ("graphs == eager, tiny Llama b8 (greedy)", _fmt(tiny.get("tiny_b8"), "sequences_identical"), "", ""),
            ("graphs == eager, tiny Llama b13 -> 16 padded",
             _fmt(tiny.get("tiny_b13_padded"), "sequences_identical"), "", ""),
            ("graphs == eager, qwen3-0.6b dummy b8",
             _fmt(qwen.get("greedy_b8_graphs_vs_eager"), "sequences_identical"), "", "")]
    b1g, b1e = llama.get("b1_graphs"), llama.get("b1_eager")
    g_ms = b1g.get("tpot_ms") if isinstance(b1g, dict) else None
    rows.append(("Llama-3.1-8B b1 1024/256: ms per output token", _fmt(b1g, "tpot_ms"), _fmt(b1e, "tpot_ms"),
                 "<= 5.45 (vLLM 6.52)"))
    gemv = llama.get("b1_gemv_ms")
    if isinstance(gemv, dict):
        rows.append(("  of which GPU: the batch-1 GEMVs alone", f"{gemv['ms']} ms", "", gemv["note"]))
    replay = llama.get("b1_graph_replay_ms")
    if isinstance(replay, dict):
        rows.append(("  of which GPU: decode graph replay alone", f"{replay['ms']} ms", "", replay["key"]))
    if floor:
        ratio = f"{g_ms / floor:.3f}x" if g_ms else "-"
        rows.append(("  weight-read floor (weights / copy bw)", f"{floor:.3f} ms ({wbytes / 1e9:.2f} GB)",
                     f"graphs = {ratio} floor", "<= 1.10x"))
    tput = res.get("llama_tput", {}) if "tput_graphs" in res.get("llama_tput", {}) else llama
    n = tput.get("tput_prompts", "?")
    note = "" if n == 1000 else f" (REDUCED to {n} prompts)"
    rows.append((f"Llama-3.1-8B {n} x 1024/1024 output tok/s{note}", _fmt(tput.get("tput_graphs"), "output_tok_s"),
                 "not run", ">= 8,050 (vLLM 6,993)"))
    rows.append(("Qwen3-0.6B 256 seqs [100,1024] output tok/s", _fmt(qwen.get("tput_graphs"), "output_tok_s"),
                 _fmt(qwen.get("tput_eager"), "output_tok_s"), ">= 20,100 (vLLM 17,514)"))
    for name, sec in (("Qwen3-0.6B", qwen), (f"Llama-3.1-8B x{n}", tput)):
        g, e = sec.get("tput_graphs"), sec.get("tput_eager")
        if isinstance(g, dict):
            idle = lambda r: ("overlapped" if r["scheduler_ms_per_step"] is None
                              else round(r["scheduler_ms_per_step"] + r["outside_engine_ms_per_step"], 3))
            rows.append((f"  {name}: ms per step / of which outside the runner (GPU idle)",
                         f"{g['ms_per_step']} / {idle(g)}",
                         f"{e['ms_per_step']} / {idle(e)}" if isinstance(e, dict) else "", f"{g['steps']} steps"))
    rows += gpu_sections_hf.table_rows(res.get("hf", {}), llama, qwen)
    rows += gpu_sections_serving.table_rows(res.get("serving", {}))
    lines = ["| measure | CUDA graphs | eager | target |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    prof = res.get("profile", {})
    if "device_ms_per_step" in prof:
        lines.append(f"| {prof.get('preset')} decode step, {prof.get('running')} running: wall ms / device ms "
                     f"(profiled) | {prof.get('ms_per_step')} | {prof.get('device_ms_per_step')} | profile.txt |")
    status = ", ".join(f"{k}: {v.get('status')} {v.get('wall_s')} s" for k, v in res.items())
    mode = "overlap scheduling (scheduler.enable_overlap)" if gpu_measure.OVERLAP else "synchronous scheduling"
    return "\n".join(lines) + f"\n\nsections: {status}\nmode: {mode}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="256 prompts instead of 1000 for the 8B throughput run")
    p.add_argument("--budget-s", type=float, default=430.0, help="wall budget of the whole run")
    p.add_argument("--tput-prompts", type=int, default=0, help="8B throughput prompts (default 1000, --quick 256)")
    p.add_argument("--only", default="copy,tiny,qwen,llama",
                   help="sections, comma-separated (also: llama_tput, profile, serving, hf)")
    p.add_argument("--serving-prompts", default="8,64,192", help="serving: prompts per concurrency level")
    p.add_argument("--serving-concurrency", default="1,16,64", help="serving: max concurrency levels")
    p.add_argument("--hf-out", type=int, default=64, help="hf: output tokens of the 8B batch-1 run")
    p.add_argument("--hf-seqs", type=int, default=16, help="hf: sequences of the Qwen3-0.6B workload run")
    p.add_argument("--profile-preset", default="qwen3-0.6b", choices=("qwen3-0.6b", "llama-3.1-8b"),
                   help="profile: the model shape")
    p.add_argument("--profile-prompt", type=int, default=512, help="profile: prompt tokens of each request")
    p.add_argument("--profile-batch", type=int, default=256, help="profile: running requests")
    p.add_argument("--json", default=None)
    p.add_argument("--no-overlap", action="store_true", help="the synchronous loop (default: overlap, as served)")
    p.add_argument("--engine-default-budget", action="store_true",
                   help="llama sections: the engine's default step budget instead of the 8B recipe's")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any device: checks this script, not speed")
    p.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)
    p.add_argument("--section-json", help=argparse.SUPPRESS)
    p.add_argument("--section-budget", type=float, default=300.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    gpu_measure.OVERLAP = not args.no_overlap
    if args.section:
        SECTIONS[args.section](Recorder(Path(args.section_json)), args)
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through _run_section: its section stops too
    start = time.monotonic()
    names = [n for n in args.only.split(",") if n]
    unknown = sorted(set(names) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; known: {sorted(SECTIONS)}")
    gpu_sections_serving.parse_levels(args.serving_prompts, args.serving_concurrency)  # fail before any section
    res: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as work:
        for i, name in enumerate(names):
            left = args.budget_s - (time.monotonic() - start)
            later = sum(min(SECTION_CAPS[n], 60) for n in names[i + 1 :])  # keep a little for what follows
            budget = min(SECTION_CAPS[name] + (max(0, left - SECTION_CAPS[name]) if name in GROWS else 0),
                         left - later)
            if budget < 20:
                res[name] = {"status": f"skipped ({left:.0f} s left)"}
                continue
            res[name] = _run_section(name, args, budget, Path(work))
        dest = Path(args.json) if args.json else (Path(os.environ["OUT"]) / "bench_gpu.json"
                                                  if os.environ.get("OUT") else None)
        for extra in ("profile.txt", "run_profile.txt", "host_profile.txt", "serving_server.log"):
            if (Path(work) / extra).exists() and dest is not None:
                (dest.parent / extra).write_text((Path(work) / extra).read_text())
    if "hf" in res:
        res["hf"]["speedup_appliance_over_transformers"] = gpu_sections_hf.ratios(res["hf"], res.get("llama", {}),
                                                                                  res.get("qwen", {}))
    if dest:
        dest.write_text(json.dumps(res, indent=1))
    print("\n" + table(res))


if __name__ == "__main__":
    main()
