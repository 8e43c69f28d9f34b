#!/usr/bin/env python3
"""Host time per step of the engine loop alone (scheduler plan + update), with an executor that answers at once.

In overlap mode the GPU idles whenever a step's host work outlasts the step in flight, so at large batches the
per-request cost of planning and applying a step bounds throughput (tools/bench_gpu.py run_profile measures the
GPU's idle share). This times the engine's part on any machine, on the Qwen3 workload's shape (256 requests, in
and out lengths uniform in [100, 1024], seed 0):

    python3 tools/bench_host.py [--requests 256] [--sync] [--prefix-caching] [--profile]

Prints one dict: steps, tokens (generated: the sum of the workload's output lengths), seconds, and microseconds
per step and per token (a token is one scheduled decode row, so per token = per scheduled request per step).
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_measure import qwen_workload

from appliance.engine.config import EngineConfig
from appliance.engine.core import EngineCore
from appliance.engine.sampling_params import SamplingParams
from appliance.engine.step import Executor, SampledToken, StepPlan, StepResult


class NullExecutor(Executor):
    """Samples token 5 for every row that samples; no model, no state."""

    def execute(self, plan: StepPlan) -> StepResult:
        return StepResult(plan.step_id, [SampledToken(s.request_id, 5) for s in plan.scheduled if s.sample])


def workload(requests: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt, output length) per request: lengths uniform in [100, 1024], token ids below 1000."""
    prompts, out_lens = qwen_workload(1000, requests, seed=seed)
    return list(zip(prompts, out_lens))


def run(requests: int, seed: int = 0, overlap: bool = True, prefix_caching: bool = False) -> dict[str, float]:
    cfg = EngineConfig(num_blocks=requests * 130, max_num_seqs=256, max_model_len=4096,
                       enable_prefix_caching=prefix_caching)
    core = EngineCore(cfg, NullExecutor(), overlap=overlap)
    for i, (prompt, out_len) in enumerate(workload(requests, seed)):
        core.add_request(f"r{i}", prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
    steps = tokens = 0
    start = time.perf_counter()
    while core.has_work():
        tokens += len(core.step())  # one delta per generated token: no speculative decoding here
        steps += 1
    took = time.perf_counter() - start
    return {"steps": steps, "tokens": tokens, "s": round(took, 3), "us_per_step": round(took / steps * 1e6, 1),
            "us_per_token": round(took / max(tokens, 1) * 1e6, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--sync", action="store_true", help="the synchronous loop instead of overlap mode")
    ap.add_argument("--prefix-caching", action="store_true", help="with the prefix cache on (off by default)")
    ap.add_argument("--profile", action="store_true", help="print the top functions (cProfile)")
    args = ap.parse_args()
    if args.requests < 1:
        ap.error("--requests must be >= 1")
    kw = {"overlap": not args.sync, "prefix_caching": args.prefix_caching}
    run(16, **kw)  # warm the imports
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        res = run(args.requests, **kw)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    else:
        res = run(args.requests, **kw)
    print(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
