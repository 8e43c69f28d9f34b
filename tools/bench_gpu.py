#!/usr/bin/env python3
"""The GPU-speed benchmark of issue 6: CUDA-graph correctness, then the three target workloads, one table.

    python3 tools/bench_gpu.py [--quick] [--overlap] [--budget-s 430] [--json PATH]

--overlap runs every model with scheduler.enable_overlap (step N+1 planned while step N runs); compare its table
with a run without it.

Sections run in subprocesses (a crash or a time-out loses one section, and each model's memory is freed):
  copy     device-to-device copy bandwidth (bytes read + written), for the weight-read floor
  tiny     greedy tokens with CUDA graphs == eager on a tiny random Llama (realistic-scale random weights)
  qwen     the same check on qwen3-0.6b (dummy weights), then 256 seqs, in/out uniform [100, 1024], seed 0:
           output tok/s with graphs and (budget allowing) eager
  llama    Llama-3.1-8B (dummy): batch 1, 1024 in / 256 out, mean time per output token (graphs and eager, and
           the weight-read floor = weight bytes read per step / copy bandwidth); then N x 1024 in / 1024 out,
           ignore_eos, output tok/s (N = 1000, or --tput-prompts; --quick uses 256 and the table says so)
Sampling as in `vllm bench`: temperature 1.0, top_p 1.0, ignore_eos. Each section writes its JSON as it goes,
so a section cut by its time limit still reports what it measured. JSON: --json, or $OUT/bench_gpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
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

import gpu_measure  # noqa: E402  (tools/ is on sys.path above)
from gpu_measure import (  # noqa: E402
    TINY,
    Recorder,
    _gemv_ms,
    _greedy_equal,
    _llm,
    _prompts,
    _replay_ms,
    _throughput,
    _tpot,
    _weight_bytes,
)

SECTION_CAPS = {"copy": 60, "tiny": 90, "qwen": 170, "llama": 300, "profile": 120}


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
    rng = random.Random(0)
    n = 256 // k
    in_lens = [rng.randint(100 // k, 1024 // k) for _ in range(n)]
    out_lens = [rng.randint(100 // k, 1024 // k) for _ in range(n)]
    prompts = _prompts(rng, cfg["vocab_size"], in_lens)
    warm = _throughput(llm, prompts[:16], [8] * 16)  # compiles any kernel variant not met yet
    rec["warmup_s"] = warm["elapsed_s"]
    g = _throughput(llm, prompts, out_lens)
    rec["tput_graphs"] = g
    if time.monotonic() + 3 * g["elapsed_s"] + 10 < deadline:
        llm.executor.runner.use_graphs = False
        rec["tput_eager"] = _throughput(llm, prompts, out_lens)
    else:
        rec["tput_eager"] = "skipped (section budget)"


def section_llama(rec: Recorder, args: argparse.Namespace) -> None:
    from bench_offline import PRESETS

    cfg = TINY if args.smoke else PRESETS["llama-3.1-8b"]
    k = 16 if args.smoke else 1
    deadline = time.monotonic() + args.section_budget
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        llm = _llm(cfg, Path(tmp))
        rec["init_s"] = round(time.perf_counter() - t, 1)
    rec["runner_warmup_s"] = round(llm.executor.runner.warmup_s, 1)
    runner = llm.executor.runner
    rec["num_kv_blocks"] = runner.num_blocks
    rec["weight_bytes_per_step"] = _weight_bytes(runner.model)
    t = time.perf_counter()
    rec["graphs_captured_upfront"] = runner.capture_graphs(2048)
    rec["capture_s"] = round(time.perf_counter() - t, 1)
    rng = random.Random(2)
    vocab = cfg["vocab_size"]
    _tpot(llm, [rng.randrange(vocab) for _ in range(1024 // k)], 8)  # warm-up
    for mode in ("graphs", "eager"):
        runner.use_graphs = mode == "graphs"
        runs = [_tpot(llm, [rng.randrange(vocab) for _ in range(1024 // k)], 256 // k) for _ in range(3)]
        rec[f"b1_{mode}"] = {"tpot_ms": round(statistics.median(r["tpot_ms"] for r in runs), 3),
                             "ttft_ms": round(statistics.median(r["ttft_ms"] for r in runs), 2), "runs": runs}
    rec["b1_graph_replay_ms"] = _replay_ms(runner)
    rec["b1_gemv_ms"] = _gemv_ms(runner.model)
    runner.use_graphs = True
    n = args.tput_prompts or (256 if args.quick else 1000) // k
    rec["tput_prompts"] = n
    left = deadline - time.monotonic()
    if left < 45:
        rec["tput_graphs"] = f"skipped ({left:.0f} s left)"
        return
    # fewer prompts when the budget is short (assumes >= 4,000 tok/s; the table names the count)
    n = max(16, min(n, int((left - 25) * 4000 / (1024 // k) / 1.3)))
    rec["tput_prompts"] = n
    rng = random.Random(0)
    rec["tput_graphs"] = _throughput(llm, _prompts(rng, vocab, [1024 // k] * n), [1024 // k] * n)


def section_profile(rec: Recorder, args: argparse.Namespace) -> None:
    """Where a large-batch decode step goes: qwen3-0.6b, 256 running requests (512 in), torch.profiler over
    20 decode-only steps after the prefills; kernel and host tables go to profile.txt beside the JSON."""
    import torch
    from bench_offline import PRESETS
    from torch.profiler import ProfilerActivity, profile

    from appliance import SamplingParams

    cfg = TINY if args.smoke else PRESETS["qwen3-0.6b"]
    k = 16 if args.smoke else 1
    with tempfile.TemporaryDirectory() as tmp:
        llm = _llm(cfg, Path(tmp), enable_prefix_caching=False)
    eng = llm.engine
    rng = random.Random(3)
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=80 if args.smoke else 400, ignore_eos=True)
    for i in range(256 // k):
        eng.add_request(f"p{i}", [rng.randrange(cfg["vocab_size"]) for _ in range(512 // k)], sp)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(5):
        eng.step()
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    steps = 20
    t = time.perf_counter()
    with profile(activities=acts) as prof:
        for _ in range(steps):
            eng.step()
    rec["ms_per_step_profiled"] = round((time.perf_counter() - t) / steps * 1e3, 3)
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    rec["ms_per_step"] = round((time.perf_counter() - t) / steps * 1e3, 3)
    rec["running"] = len(eng.scheduler.running)
    ka = prof.key_averages()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    text = ka.table(sort_by=sort, row_limit=30) + "\n\n" + ka.table(sort_by="self_cpu_time_total", row_limit=30)
    Path(args.section_json).with_name("profile.txt").write_text(text)
    dev_us = sum(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0)) for e in ka)
    rec["device_ms_per_step"] = round(dev_us / steps / 1e3, 3)
    print(ka.table(sort_by=sort, row_limit=15), flush=True)


SECTIONS = {"copy": section_copy, "tiny": section_tiny, "qwen": section_qwen, "llama": section_llama,
            "profile": section_profile}


# ---- driver --------------------------------------------------------------------------------------------------
def _run_section(name: str, args: argparse.Namespace, budget: float, workdir: Path) -> dict[str, Any]:
    out = workdir / f"{name}.json"
    cmd = [sys.executable, __file__, "--section", name, "--section-json", str(out), "--section-budget",
           str(max(budget - 15, 10))] + (["--quick"] if args.quick else []) + (["--smoke"] if args.smoke else []) + \
          (["--tput-prompts", str(args.tput_prompts)] if args.tput_prompts else []) + \
          (["--overlap"] if args.overlap else [])
    print(f"== {name} (limit {budget:.0f} s)", flush=True)
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, check=False, timeout=budget, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        status = "ok" if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        status = "timed out"
    data = json.loads(out.read_text()) if out.exists() else {}
    data["status"], data["wall_s"] = status, round(time.perf_counter() - t, 1)
    return data


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
        rows.append(("  of which GPU: the batch-1 GEMVs alone (cuBLAS)", f"{gemv['ms']} ms", "", gemv["note"]))
    replay = llama.get("b1_graph_replay_ms")
    if isinstance(replay, dict):
        rows.append(("  of which GPU: decode graph replay alone", f"{replay['ms']} ms", "", replay["key"]))
    if floor:
        ratio = f"{g_ms / floor:.3f}x" if g_ms else "-"
        rows.append(("  weight-read floor (weights / copy bw)", f"{floor:.3f} ms ({wbytes / 1e9:.2f} GB)",
                     f"graphs = {ratio} floor", "<= 1.10x"))
    n = llama.get("tput_prompts", "?")
    note = "" if n == 1000 else f" (REDUCED to {n} prompts)"
    rows.append((f"Llama-3.1-8B {n} x 1024/1024 output tok/s{note}", _fmt(llama.get("tput_graphs"), "output_tok_s"),
                 "not run", ">= 8,050 (vLLM 6,993)"))
    rows.append(("Qwen3-0.6B 256 seqs [100,1024] output tok/s", _fmt(qwen.get("tput_graphs"), "output_tok_s"),
                 _fmt(qwen.get("tput_eager"), "output_tok_s"), ">= 20,100 (vLLM 17,514)"))
    for name, sec in (("Qwen3-0.6B", qwen), (f"Llama-3.1-8B x{n}", llama)):
        g, e = sec.get("tput_graphs"), sec.get("tput_eager")
        if isinstance(g, dict):
            idle = lambda r: ("overlapped" if r["scheduler_ms_per_step"] is None
                              else round(r["scheduler_ms_per_step"] + r["outside_engine_ms_per_step"], 3))
            rows.append((f"  {name}: ms per step / of which outside the runner (GPU idle)",
                         f"{g['ms_per_step']} / {idle(g)}",
                         f"{e['ms_per_step']} / {idle(e)}" if isinstance(e, dict) else "", f"{g['steps']} steps"))
    lines = ["| measure | CUDA graphs | eager | target |", "|---|---|---|---|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    prof = res.get("profile", {})
    if "device_ms_per_step" in prof:
        lines.append(f"| qwen3-0.6b decode step, {prof.get('running')} running: wall ms / device ms (profiled) | "
                     f"{prof.get('ms_per_step')} | {prof.get('device_ms_per_step')} | profile.txt |")
    status = ", ".join(f"{k}: {v.get('status')} {v.get('wall_s')} s" for k, v in res.items())
    mode = "overlap scheduling (scheduler.enable_overlap)" if gpu_measure.OVERLAP else "synchronous scheduling"
    return "\n".join(lines) + f"\n\nsections: {status}\nmode: {mode}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="256 prompts instead of 1000 for the 8B throughput run")
    p.add_argument("--budget-s", type=float, default=430.0, help="wall budget of the whole run")
    p.add_argument("--tput-prompts", type=int, default=0)
    p.add_argument("--only", default="copy,tiny,qwen,llama", help="sections, comma-separated (also: profile)")
    p.add_argument("--json", default=None)
    p.add_argument("--overlap", action="store_true", help="scheduler.enable_overlap on (compare with a run without)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on any device: checks this script, not speed")
    p.add_argument("--section", choices=sorted(SECTIONS), help=argparse.SUPPRESS)
    p.add_argument("--section-json", help=argparse.SUPPRESS)
    p.add_argument("--section-budget", type=float, default=300.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    gpu_measure.OVERLAP = args.overlap
    if args.section:
        SECTIONS[args.section](Recorder(Path(args.section_json)), args)
        return
    start = time.monotonic()
    names = [n for n in args.only.split(",") if n]
    res: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as work:
        for i, name in enumerate(names):
            left = args.budget_s - (time.monotonic() - start)
            later = sum(min(SECTION_CAPS[n], 60) for n in names[i + 1 :])  # keep a little for what follows
            budget = min(SECTION_CAPS[name] + (0 if name != "llama" else max(0, left - SECTION_CAPS[name])),
                         left - later)
            if budget < 20:
                res[name] = {"status": f"skipped ({left:.0f} s left)"}
                continue
            res[name] = _run_section(name, args, budget, Path(work))
        dest = Path(args.json) if args.json else (Path(os.environ["OUT"]) / "bench_gpu.json"
                                                  if os.environ.get("OUT") else None)
        prof = Path(work) / "profile.txt"
        if prof.exists() and dest is not None:
            (dest.parent / "profile.txt").write_text(prof.read_text())
    if dest:
        dest.write_text(json.dumps(res, indent=1))
    print("\n" + table(res))


if __name__ == "__main__":
    main()
