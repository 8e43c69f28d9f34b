#!/usr/bin/env python3
"""A throughput run through the real scheduler over a pure-Python executor, timed by a step cost model fitted on
the H100: how many steps a workload plans, how many requests run at once, and what that costs, without a GPU.

    python3 tools/sim_tput.py                        # the 8B benchmark: 1000 x 1024/1024 ignore_eos
    python3 tools/sim_tput.py --what-if finish-time  # + SGLang's finish-time admission for ignore_eos requests

The model (Llama-3.1-8B bf16, session 7's step times, docs/benchmarks.md "Eighth run"): a step costs STEP_MS, plus
ROW_US per decode row, plus KV_NS per context token the decode rows read, plus PREFILL_US per prefill token.
Fitted to the measured 22.13 ms steps of ~212 rows at ~1,536 tokens, 9.54 ms steps of 44 rows and 196 ms
prefill steps of 8,192 tokens, it gives the 1000-prompt run 5,139 steps and 133.3 s against 5,144 and 134.3 s
measured. It is a model of one shape on one GPU: use it to compare scheduling choices, not as a benchmark.

--what-if finish-time admits an ignore_eos request also when the static reservation (engine/admission.py) says
no, if a simulation of the running requests' growth until each of them finishes (SGLang's
PrefillAdder.add_one_req_ignore_eos) never runs out of blocks, with one block of margin per request.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_host import NullExecutor  # noqa: E402

from appliance.engine import (  # noqa: E402
    EngineConfig,
    EngineCore,
    SamplingParams,
    admission,
    scheduler,
)
from appliance.engine.step import StepPlan, StepResult  # noqa: E402

STEP_MS, ROW_US, KV_NS, PREFILL_US = 6.25, 6.8, 44.4, 23.9


class CountingExecutor(NullExecutor):
    """bench_host's NullExecutor (token 5 for every sampling row) that also logs each step's (decode rows, context
    they read, prefill tokens)."""

    def __init__(self) -> None:
        self.context: dict[str, int] = {}
        self.steps: list[tuple[int, int, int]] = []

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_ids:
            self.context.pop(rid, None)
        rows = read = prefill = 0
        for s in plan.scheduled:
            seen = self.context[s.request_id] = self.context.get(s.request_id, 0) + s.num_tokens
            if s.num_tokens == 1:
                rows, read = rows + 1, read + seen
            else:
                prefill += s.num_tokens
        self.steps.append((rows, read, prefill))
        return super().execute(plan)


def cost(steps: list[tuple[int, int, int]]) -> dict[str, float]:
    """Modelled seconds by part."""
    parts = {"per_step_s": STEP_MS * 1e-3 * len(steps), "per_row_s": ROW_US * 1e-6 * sum(r for r, _, _ in steps),
             "kv_reads_s": KV_NS * 1e-9 * sum(k for _, k, _ in steps),
             "prefill_s": PREFILL_US * 1e-6 * sum(p for _, _, p in steps)}
    return {**{k: round(v, 2) for k, v in parts.items()}, "total_s": round(sum(parts.values()), 2)}


def finish_time_admission() -> None:
    """Wrap OutputReservation.fits with SGLang's finish-time simulation for ignore_eos requests (this process)."""
    init, fits = scheduler.Scheduler.__init__, admission.OutputReservation.fits

    def scheduler_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self._reserve is not None:
            self._reserve.running = self.running

    def simulated_fits(self: Any, req: Any, spare: int, extra: int = 0) -> bool:
        if fits(self, req, spare, extra):
            return True
        if not req.sampling_params.ignore_eos:
            return False
        bs = self.block_size
        rows = []  # (tokens left to generate, tokens now, blocks held), the new request included
        for r in self.running:
            done = len(r.output_token_ids) + r.num_pending
            left = r.max_output_tokens - done
            if not r.sampling_params.ignore_eos:
                left = self.ratio * min(left, admission.CLIP_MAX_NEW_TOKENS)
            if left > 0:
                rows.append((left, r.num_prompt_tokens + done, len(r.block_ids)))
        rows.append((req.max_output_tokens, req.num_tokens, -(-(req.num_tokens - extra) // bs)))
        rows.sort()
        tokens, held, alive, freed = sum(t for _, t, _ in rows), sum(h for _, _, h in rows), len(rows), 0
        for left, t, h in rows:  # just before each finishes: the others have grown by its `left` too
            if spare + freed < (tokens + alive * left) / bs + alive - held:
                return False
            freed, tokens, held, alive = freed + h, tokens - t, held - h, alive - 1
        return True

    scheduler.Scheduler.__init__ = scheduler_init
    admission.OutputReservation.fits = simulated_fits


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.what_if == "finish-time":
        finish_time_admission()
    cfg = EngineConfig(num_blocks=args.num_blocks, block_size=16, max_num_seqs=args.max_num_seqs,
                       chunked_prefill_size=args.chunk, max_model_len=args.input_len + args.output_len + 16,
                       eos_token_ids={0}, schedule_conservativeness=args.conservativeness)
    ex = CountingExecutor()
    core = EngineCore(cfg, ex, overlap=False)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.prompts):
        core.add_request(f"r{i}", [1 + (i * 7 + j) % 1000 for j in range(args.input_len)], sp)
    most = 0
    while core.has_work():
        core.step()
        most = max(most, len(core.scheduler.running))
    modelled = cost(ex.steps)
    tokens = args.prompts * args.output_len
    return {"what_if": args.what_if, "steps": len(ex.steps), "max_running": most,
            "preemptions": core.stats().num_preemptions, **modelled,
            "output_tok_s": round(tokens / modelled["total_s"], 1) if modelled["total_s"] else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--num-blocks", type=int, default=27319, help="KV blocks of 16 tokens (the 8B run's pool)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=8192, help="scheduler.chunked_prefill_size")
    ap.add_argument("--conservativeness", type=float, default=1.0, help="scheduler.schedule_conservativeness")
    ap.add_argument("--what-if", choices=("none", "finish-time"), default="none")
    print(json.dumps(run(ap.parse_args())), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
