"""The `profile` section of tools/bench_gpu.py: where a large-batch decode step goes (torch.profiler)."""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu_measure import TINY, Recorder, _llm


def _device_us(event: Any) -> float:
    """A profiler row's own device time in us (torch renamed the field from self_cuda_time_total)."""
    return getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0))


def section_profile(rec: Recorder, args: argparse.Namespace) -> None:
    """Where a decode step goes: `--profile-preset` (qwen3-0.6b; or llama-3.1-8b), `--profile-batch` running
    requests (256; `--profile-prompt` tokens in, 512), torch.profiler over 20 decode-only steps after the prefills;
    kernel and host tables go to profile.txt beside the JSON."""
    import torch
    from bench_offline import PRESETS
    from torch.profiler import ProfilerActivity, profile

    from appliance import SamplingParams

    preset = getattr(args, "profile_preset", "qwen3-0.6b")
    cfg = TINY if args.smoke else PRESETS[preset]
    prompt = getattr(args, "profile_prompt", 512)
    batch = getattr(args, "profile_batch", 256)
    k = 16 if args.smoke else 1
    with tempfile.TemporaryDirectory() as tmp:
        llm = _llm(cfg, Path(tmp), enable_prefix_caching=False)
    eng = llm.engine
    rng = random.Random(3)
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=80 if args.smoke else 400, ignore_eos=True)
    for i in range(max(1, batch // k)):
        eng.add_request(f"p{i}", [rng.randrange(cfg["vocab_size"]) for _ in range(prompt // k)], sp)
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
    rec["preset"], rec["prompt"] = ("tiny" if args.smoke else preset), prompt
    ka = prof.key_averages()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    text = ka.table(sort_by=sort, row_limit=30) + "\n\n" + ka.table(sort_by="self_cpu_time_total", row_limit=30)
    Path(args.section_json).with_name("profile.txt").write_text(text)
    dev_us = sum(_device_us(e) for e in ka)
    rec["device_ms_per_step"] = round(dev_us / steps / 1e3, 3)
    print(ka.table(sort_by=sort, row_limit=15), flush=True)


# kernel name fragment -> category of the run profile (first match wins; names as torch.profiler shows them)
CATEGORIES = (("decode attention", ("_decode_kernel", "_merge_kernel")), ("prefill attention", ("_prefill",)),
              ("GEMV (<= 16 rows)", ("_gemv_kernel",)), ("GEMM (Triton, 17-256 rows)", ("_skinny_gemm",)),
              ("GEMM (cuBLAS)", ("gemm", "nvjet", "xmma", "cutlass", "sm90")),
              ("norm, rope+store, SiLU", ("_rms_norm", "_rope", "_silu", "_store")),
              ("sampling", ("_sample", "_chunk_kernel", "argmax", "_row_kernel")),
              ("copies, gathers, casts (torch)", ("at::native", "Memcpy", "Memset")))


GAP_BUCKETS_US = (2.0, 10.0, 100.0)  # idle gaps: kernel boundaries (< 2 us, < 10 us), short stalls, host stalls


def gap_histogram(intervals: list[tuple[float, float]]) -> dict[str, dict[str, float]]:
    """Idle time between device activity, by gap length: intervals are (start_us, end_us) of kernels and copies
    (overlaps merged). A run whose idle is mostly < 2 us gaps loses it to kernel boundaries inside the steps;
    >= 100 us gaps are the device waiting for the host."""
    edges = (0.0, *GAP_BUCKETS_US, float("inf"))
    names = [f"{lo:g}-{hi:g} us" if hi != float("inf") else f">= {lo:g} us" for lo, hi in zip(edges, edges[1:])]
    out = {n: {"count": 0, "s": 0.0} for n in names}
    end = None
    for start, stop in sorted(intervals):
        if end is not None and start > end:
            gap = start - end
            name = names[next(i for i, hi in enumerate(edges[1:]) if gap < hi)]
            out[name]["count"] += 1
            out[name]["s"] += gap / 1e6
        end = stop if end is None else max(end, stop)
    return {n: {"count": v["count"], "s": round(v["s"], 6)} for n, v in out.items()}


def _device_intervals(prof: Any) -> list[tuple[float, float]]:
    """(start_us, end_us) of every device event a torch.profiler run recorded."""
    from torch.autograd import DeviceType

    return [(e.time_range.start, e.time_range.end) for e in prof.events()
            if getattr(e, "device_type", None) == DeviceType.CUDA and e.time_range.end > e.time_range.start]


def section_run_profile(rec: Recorder, args: argparse.Namespace) -> None:
    """Where a whole throughput run goes: the Qwen3-0.6B workload (256 sequences, in/out uniform [100, 1024], seed
    0; or with --profile-preset llama-3.1-8b, --tput-prompts of 1024 in / 1024 out) once plain for its wall
    time, then under torch.profiler (device activity only); device time per kernel category, the GPU's idle
    share = 1 - busy / wall of the plain run, and the idle gaps by length. Then once under cProfile: the host's
    share (the GPU idles whenever a step's host work outlasts the step in flight), top functions in
    host_profile.txt beside the JSON."""
    import torch
    from bench_offline import PRESETS
    from gpu_measure import _throughput, llama_workload, qwen_workload
    from torch.profiler import ProfilerActivity, profile

    preset = getattr(args, "profile_preset", "qwen3-0.6b")
    cfg = TINY if args.smoke else PRESETS[preset]
    k = 16 if args.smoke else 1
    with tempfile.TemporaryDirectory() as tmp:
        llm = _llm(cfg, Path(tmp), enable_prefix_caching=False)
    llm.executor.runner.capture_graphs(2048)
    if preset == "qwen3-0.6b":
        ids, out_lens = qwen_workload(cfg["vocab_size"], 256 // k, k)
        prompts = [{"prompt_token_ids": p} for p in ids]
    else:  # the 8B throughput workload, --tput-prompts of 1024 in / 1024 out (default 256: three runs fit a call)
        prompts, out_lens = llama_workload(cfg["vocab_size"], (getattr(args, "tput_prompts", 0) or 256) // k, k)
    rec["workload"] = f"{preset}: {len(prompts)} prompts"
    _throughput(llm, prompts[:16], [8] * len(prompts[:16]))  # compiles what the run meets
    plain = _throughput(llm, prompts, out_lens)
    rec["plain"] = plain
    acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        rec["profiled"] = _throughput(llm, prompts, out_lens)
    ka = prof.key_averages()
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    Path(args.section_json).with_name("run_profile.txt").write_text(ka.table(sort_by=sort, row_limit=40))
    totals: dict[str, float] = {}
    for e in ka:
        us = _device_us(e)
        if not us:
            continue
        cat = next((c for c, frags in CATEGORIES if any(f in e.key for f in frags)), "other: " + e.key[:60])
        totals[cat] = totals.get(cat, 0.0) + us / 1e6
    busy = sum(totals.values())
    rec["device_s_by_category"] = {c: round(s, 3) for c, s in sorted(totals.items(), key=lambda kv: -kv[1])[:14]}
    rec["device_busy_s"] = round(busy, 3)
    rec["gpu_idle_share_of_plain_wall"] = round(1 - busy / plain["elapsed_s"], 3) if plain["elapsed_s"] else None
    rec["idle_gaps_profiled"] = gap_histogram(_device_intervals(prof))
    import cProfile
    import io
    import pstats

    host = cProfile.Profile()
    host.enable()
    rec["cprofiled"] = _throughput(llm, prompts, out_lens)
    host.disable()
    text = io.StringIO()
    stats = pstats.Stats(host, stream=text)
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(45)
    Path(args.section_json).with_name("host_profile.txt").write_text(text.getvalue())
