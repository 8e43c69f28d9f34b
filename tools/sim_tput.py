#!/usr/bin/env python3
"""A throughput run through the real scheduler over a pure-Python executor, timed by a step cost model fitted on
the H100: how many steps a workload plans, how many requests run at once, and what that costs, without a GPU.

    python3 tools/sim_tput.py                        # the 8B benchmark: 1000 x 1024/1024 ignore_eos
    python3 tools/sim_tput.py --what-if sum-only     # without the finish-time admission check (engine/admission.py)
    python3 tools/sim_tput.py --what-if ramp:0.25 --chunk 2048 --model roofline
    python3 tools/sim_tput.py --sweep                # the admission variants of session 13, as a table

Two step cost models (Llama-3.1-8B bf16, session 7's step times, docs/benchmarks.md "Eighth run"); both report.
additive: STEP_MS, plus ROW_US per decode row, plus KV_NS per context token the decode rows read, plus PREFILL_US
per prefill token. It gives the 1000-prompt run 5,139 steps and 133.3 s against 5,144 and 134.3 s measured.
roofline: (A^p + (B*M)^p)^(1/p) over M = decode rows + prefill tokens (the GEMMs: weight-read-bound at small M,
FLOP-bound at large M, so decode rows riding in a prefill step cost their FLOPs only), plus the same KV_NS term;
A and B are fitted (relative least squares) to the same three measured shapes for the given p. p = 2 is a guess
at the knee's sharpness: p = 2.5 fits the three points best; --sweep also prices each run at p = 1.5, 2.5, 4.
Either is a model of one shape on one GPU: use it to compare scheduling choices, not as a benchmark.

What-ifs (joined with '+'; each monkeypatches the engine's classes for this process only):
sum-only     admission by the reservation sum alone: the engine's finish-time check (engine/admission.py,
             SGLang's PrefillAdder.add_one_req_ignore_eos simulation of when each running request frees its
             blocks) turned off, as before session 14.
ramp:R       admit at most R new requests per step on average (token bucket); preempted ones are exempt.
reserve:F    reserve only F of the ignore_eos requests' remaining outputs: admit more, preempt (recompute) later.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_host import NullExecutor

from appliance.engine import (
    EngineConfig,
    EngineCore,
    RequestStatus,
    SamplingParams,
    admission,
    scheduler,
)
from appliance.engine.step import StepPlan, StepResult

STEP_MS, ROW_US, KV_NS, PREFILL_US = 6.25, 6.8, 44.4, 23.9
# (M rows or tokens, context tokens per decode row, measured ms): 212- and 44-row decode steps, 8192-token prefill
MEASURED = ((212, 1536, 22.13), (44, 1536, 9.54), (8192, 0, 196.0))
# (p, ms per step that no compute hides: launches, host) for the sensitivity columns; (2.5, 0) and (3, 1) fit the
# three MEASURED shapes to 0.3 ms, p = 2 to 3.5 ms (its 8192-token step), p = 1.5 to 9 ms
SENSITIVITY = ((1.5, 0.0), (2.5, 0.0), (4.0, 0.0), (3.0, 1.0))

Step = tuple[int, int, int]  # (decode rows, context tokens they read, prefill tokens)


class CountingExecutor(NullExecutor):
    """bench_host's NullExecutor (token 5 for every sampling row) that also logs each step's (decode rows, context
    they read, prefill tokens). A chunk is a decode row when the request's previous chunk sampled: a 1-token
    prefill chunk (a budget's remainder) is still prefill. A preempted request is forgotten (finished_ids), so
    its recompute is logged as prefill."""

    def __init__(self) -> None:
        self.context: dict[str, int] = {}
        self.sampled: set[str] = set()
        self.steps: list[Step] = []

    def execute(self, plan: StepPlan) -> StepResult:
        for rid in plan.finished_ids:
            self.context.pop(rid, None)
            self.sampled.discard(rid)
        for new in plan.new_requests:  # a prefix-cache hit is context the executor did not compute
            self.context[new.request_id] = new.num_computed_tokens
        rows = read = prefill = 0
        for s in plan.scheduled:
            seen = self.context[s.request_id] = self.context[s.request_id] + s.num_tokens
            if s.request_id in self.sampled:
                rows, read = rows + 1, read + seen
            else:
                prefill += s.num_tokens
            if s.sample:
                self.sampled.add(s.request_id)
        self.steps.append((rows, read, prefill))
        return super().execute(plan)


def cost(steps: list[Step]) -> dict[str, float]:
    """Modelled seconds by part, additive model."""
    parts = {"per_step_s": STEP_MS * 1e-3 * len(steps), "per_row_s": ROW_US * 1e-6 * sum(r for r, _, _ in steps),
             "kv_reads_s": KV_NS * 1e-9 * sum(k for _, k, _ in steps),
             "prefill_s": PREFILL_US * 1e-6 * sum(p for _, _, p in steps)}
    return {**{k: round(v, 2) for k, v in parts.items()}, "total_s": round(sum(parts.values()), 2)}


def roofline_fit(p: float, fixed: float = 0.0) -> tuple[float, float]:
    """(A ms, B ms per row) minimising the relative error of f^p = A^p + B^p M^p at MEASURED, less `fixed` ms:
    linear in (A^p, B^p), so a 2x2 weighted least squares."""
    s00 = s01 = s11 = r0 = r1 = 0.0  # normal equations of the rows (1, M^p) . (A^p, B^p) = f^p, weighted 1/f^p
    for m, ctx, ms in MEASURED:
        f = ms - fixed - KV_NS * 1e-6 * m * ctx  # the GEMM part: the KV reads stay additive in both models
        w, x, y = f ** (-2 * p), float(m) ** p, f ** p
        s00, s01, s11, r0, r1 = s00 + w, s01 + w * x, s11 + w * x * x, r0 + w * y, r1 + w * x * y
    det = s00 * s11 - s01 * s01
    return ((r0 * s11 - s01 * r1) / det) ** (1 / p), ((s00 * r1 - s01 * r0) / det) ** (1 / p)


def roofline(steps: list[Step], p: float = 2.0, fixed: float = 0.0) -> float:
    """Modelled seconds, roofline model; `fixed` ms of every step are not hidden under compute."""
    a, b = roofline_fit(p, fixed)
    gemm = sum(fixed + (a ** p + (b * (rows + pre)) ** p) ** (1 / p) for rows, _, pre in steps) * 1e-3
    return round(gemm + KV_NS * 1e-9 * sum(k for _, k, _ in steps), 2)


def ramp_admission(rate: float) -> None:
    """At most `rate` new requests per step (token bucket of depth 1 + rate, so a fraction is not lost):
    requests admitted at different steps finish at different steps, which breaks the waves. Preempted requests
    are not held back (they hold progress already). Head-of-line as the scheduler: a refusal ends the step's
    admission."""
    schedule, admit = scheduler.Scheduler.schedule, scheduler.Scheduler._admit

    def rated_schedule(self: Any) -> Any:
        self.ramp_bucket = min(getattr(self, "ramp_bucket", 0.0) + rate, 1.0 + rate)
        return schedule(self)

    def rated_admit(self: Any, req: Any, st: Any) -> bool:
        fresh = req.status is RequestStatus.WAITING
        if fresh and self.ramp_bucket < 1:
            return False
        if not admit(self, req, st):
            return False
        self.ramp_bucket -= fresh
        return True

    scheduler.Scheduler.schedule = rated_schedule
    scheduler.Scheduler._admit = rated_admit


def reserve_fraction(frac: float) -> None:
    """Reserve frac of the ignore_eos outputs instead of all: the pool runs short before the wave ends and the
    scheduler preempts its newest requests (recompute), which then restart out of step with the rest."""
    reserved = admission.OutputReservation.reserved_tokens

    def fractional(self: Any, req: Any = None, extra_tokens: int = 0) -> float:
        certain = self.certain + (admission._clipped_remaining(req) if req is not None
                                  and req.sampling_params.ignore_eos else 0)
        return reserved(self, req, extra_tokens) - (1 - frac) * certain

    admission.OutputReservation.reserved_tokens = fractional


def apply_what_if(spec: str) -> None:
    for item in spec.split("+"):
        name, _, arg = item.partition(":")
        if name == "sum-only":
            admission.OutputReservation.fits_by_finish_time = lambda *args, **kwargs: False  # the sum alone
        elif name == "ramp":
            ramp_admission(float(arg))
        elif name == "reserve":
            reserve_fraction(float(arg))
        elif name != "none":
            raise SystemExit(f"unknown --what-if {item!r}: none, sum-only, ramp:R, reserve:F")


def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_what_if(args.what_if)
    cfg = EngineConfig(num_blocks=args.num_blocks, block_size=16, max_num_seqs=args.max_num_seqs,
                       chunked_prefill_size=args.chunk, max_model_len=args.input_len + args.output_len + 16,
                       eos_token_ids={0}, schedule_conservativeness=args.conservativeness)
    ex = CountingExecutor()
    core = EngineCore(cfg, ex, overlap=args.overlap)
    sp = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for i in range(args.prompts):
        core.add_request(f"r{i}", [1 + (i * 7 + j) % 1000 for j in range(args.input_len)], sp)
    most = total = 0
    while core.has_work():
        core.step()
        most, total = max(most, len(core.scheduler.running)), total + len(core.scheduler.running)
    additive = cost(ex.steps)
    roof = roofline(ex.steps, args.roofline_p)
    primary = additive["total_s"] if args.model == "additive" else roof
    tokens = args.prompts * args.output_len
    return {"what_if": args.what_if, "chunk": args.chunk, "max_num_seqs": args.max_num_seqs, "model": args.model,
            "steps": len(ex.steps),
            "max_running": most, "mean_running": round(total / max(len(ex.steps), 1), 1),
            "mean_rows": round(sum(r for r, _, _ in ex.steps) / max(len(ex.steps), 1), 1),
            "preemptions": core.stats().num_preemptions,
            "recomputed_tokens": sum(p for _, _, p in ex.steps) - args.prompts * args.input_len,
            **{k: v for k, v in additive.items() if k != "total_s"}, "additive_s": additive["total_s"],
            "roofline_s": roof, "roofline_sensitivity": [roofline(ex.steps, p, f) for p, f in SENSITIVITY],
            "total_s": primary, "output_tok_s": round(tokens / primary, 1) if primary else None}


# (what-if, chunk, max_num_seqs): the baseline, smaller chunks, the wave-breakers alone and combined, and (last)
# what the 256-seat cap costs the staggered population
SWEEP = [("sum-only", 8192, 256), ("none", 8192, 256), ("sum-only", 2048, 256), ("sum-only", 1024, 256),
         ("sum-only", 512, 256), ("none", 512, 256), ("ramp:0.25+sum-only", 8192, 256),
         ("ramp:1+sum-only", 8192, 256), ("ramp:0.25", 8192, 256), ("ramp:0.5", 8192, 256), ("ramp:1", 8192, 256),
         ("ramp:0.25", 1024, 256), ("ramp:0.25", 512, 256), ("reserve:0.9+sum-only", 8192, 256),
         ("reserve:0.8+sum-only", 8192, 256), ("reserve:0.7+sum-only", 8192, 256),
         ("reserve:0.8+sum-only", 1024, 256), ("reserve:0.8+ramp:0.5+sum-only", 8192, 256),
         ("reserve:0.9", 8192, 256), ("ramp:0.28", 8192, 320), ("ramp:0.3", 8192, 320), ("ramp:0.28", 1024, 320),
         ("ramp:0.28", 512, 320)]


def sweep(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each variant in its own process (the what-ifs patch classes), --jobs at a time; a markdown table."""
    base = [sys.executable, __file__, "--prompts", str(args.prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--num-blocks", str(args.num_blocks),
            "--roofline-p", str(args.roofline_p)]

    def one(v: tuple[str, int, int]) -> dict[str, Any]:
        cmd = [*base, "--what-if", v[0], "--chunk", str(v[1]), "--max-num-seqs", str(v[2])]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        return json.loads(out.strip().splitlines()[-1])

    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(one, SWEEP))
    tokens = args.prompts * args.output_len
    sens = " / ".join(f"p={p:g}" + (f"+{f:g}ms" if f else "") for p, f in SENSITIVITY)
    print("| what-if | chunk | seats | steps | max run | mean run | preempt | recomputed | additive s | tok/s "
          f"| roofline s | tok/s | roofline s at {sens} |")
    print("|---" * 13 + "|")
    for r in rows:
        print(f"| {r['what_if']} | {r['chunk']} | {r['max_num_seqs']} | {r['steps']} | {r['max_running']} "
              f"| {r['mean_running']} | {r['preemptions']} | {r['recomputed_tokens']} | {r['additive_s']} "
              f"| {tokens / r['additive_s']:.0f} | {r['roofline_s']} | {tokens / r['roofline_s']:.0f} | "
              + " / ".join(str(v) for v in r["roofline_sensitivity"]) + " |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--num-blocks", type=int, default=27319, help="KV blocks of 16 tokens (the 8B run's pool)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=8192, help="scheduler.chunked_prefill_size")
    ap.add_argument("--conservativeness", type=float, default=1.0, help="scheduler.schedule_conservativeness")
    ap.add_argument("--what-if", default="none", help="none, sum-only, ramp:R, reserve:F, joined with '+'")
    ap.add_argument("--model", choices=("additive", "roofline"), default="additive",
                    help="which model gives total_s and output_tok_s (both are reported)")
    ap.add_argument("--roofline-p", type=float, default=2.0, help="the roofline's knee exponent")
    ap.add_argument("--overlap", action="store_true",
                    help="plan each step while the last is in flight, as the engine runs on a GPU by default")
    ap.add_argument("--sweep", action="store_true", help="run the SWEEP variants, print a markdown table")
    ap.add_argument("--jobs", type=int, default=2, help="--sweep: variants run at once")
    args = ap.parse_args()
    if args.sweep:
        sweep(args)
    else:
        print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
