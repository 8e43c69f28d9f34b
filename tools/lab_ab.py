#!/usr/bin/env python3
"""A/B of a module-level kernel knob in one process, alternating its values: greedy tokens must not change, and
the Llama-3.1-8B batch-1 step (or its N x 1024/1024 throughput run) / the Qwen3-0.6B throughput run say what
each value is worth.

    python3 tools/lab_ab.py --preset llama-3.1-8b [--rounds 2] [--knob MODULE.NAME=V1,V2,...]
    python3 tools/lab_ab.py --preset qwen3-0.6b [--rounds 2] [--knob ...]
    python3 tools/lab_ab.py --preset llama-3.1-8b --tput-prompts 1000 [--rounds 1] [--knob ...]  # N x 1024/1024
    python3 tools/lab_ab.py --smoke          # a tiny Qwen3 on any device (the harness only)

The knob defaults to appliance.layers.attention.LONGEST_FIRST_MIN_ROWS=96,100000; another:
appliance.kernels.triton.decode.PROGRAMS_PER_SM=2,4 (tuning constants: settings a deployment may change are config
fields, backends.* / scheduler.*). Values are Python literals; the first is the baseline.
Each switch rebuilds the runner's decode and piecewise graphs (a graph keeps the launches it captured); the
throughput runs capture every size and bucket before timing. Prints one JSON line per measure, then RESULT.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_offline import PRESETS
from bench_overlap import gen, llm_for
from gpu_measure import (
    QWEN_SMOKE_SHAPE,
    _replay_ms,
    _tpot,
    llama_workload,
    qwen_requests,
    run_params,
)

DEFAULT_KNOB = "appliance.layers.attention.LONGEST_FIRST_MIN_ROWS=96,100000"


class Knob:
    """A module attribute and the values to try: `MODULE.NAME=V1,V2`."""

    def __init__(self, spec: str) -> None:
        path, _, values = spec.partition("=")
        module, _, self.name = path.rpartition(".")
        if not module or not values:
            raise SystemExit(f"--knob {spec!r}: expected MODULE.NAME=V1,V2,...")
        self.module = importlib.import_module(module)
        if not hasattr(self.module, self.name):
            raise SystemExit(f"--knob {spec!r}: {module} has no {self.name}")
        self.values = [ast.literal_eval(v) for v in values.split(",")]

    def label(self, value: Any) -> str:
        return f"{self.name}={value!r}"


def switch(runner: Any, knob: Knob, value: Any, capture_all: bool = False) -> float:
    """Set the knob, rebuild the decode graphs and the piecewise ones (their buckets are captured on first use,
    or all now with capture_all); returns the seconds it took."""
    import torch

    t = time.perf_counter()
    setattr(knob.module, knob.name, value)
    runner.graphs = runner.pieces = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    runner.graphs = runner._make_graphs()
    runner.pieces = runner._make_pieces()
    if capture_all:
        runner.capture_graphs(2048)
        if runner.pieces is not None:
            with torch.inference_mode():
                runner.pieces.capture_all()
    return time.perf_counter() - t


def rotation(values: list[Any], r: int) -> list[Any]:
    """Round r's order of the values: each round starts one later, so no value always runs first."""
    k = r % len(values)
    return values[k:] + values[:k]


def greedy(llm: Any, prompts: list[dict[str, list[int]]], n: int) -> list[list[int]]:
    from appliance import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]


def equality(llm: Any, knob: Knob, vocab: int, batches: list[int], n: int) -> dict[str, Any]:
    """Greedy tokens under every value of the knob for several batch sizes (GEMV and cuBLAS paths, split and
    unsplit decode): any race between launches, or a variant computing something else, shows as a different
    token."""
    rng = random.Random(5)
    out: dict[str, Any] = {}
    runner = llm.executor.runner
    for b in batches:
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(20, 300))]}
                   for _ in range(b)]
        got = []
        for value in knob.values:
            switch(runner, knob, value)
            got.append(greedy(llm, prompts, n))
        same = sum(all(g[i] == got[0][i] for g in got[1:]) for i in range(b))
        out[f"b{b}"] = f"{same}/{b}"
    out["ok"] = all(v == f"{b}/{b}" for b, v in zip(batches, out.values()))
    return out


def llama_b1(llm: Any, knob: Knob, vocab: int, rounds: int, k: int) -> dict[str, Any]:
    runner = llm.executor.runner
    rng = random.Random(2)
    prompt = [rng.randrange(vocab) for _ in range(1024 // k)]
    res: dict[str, list[float]] = {}
    for r in range(rounds):
        for value in rotation(knob.values, r):
            name = knob.label(value)
            switch(runner, knob, value)
            _tpot(llm, prompt, 8)  # captures the graph this key uses
            run = _tpot(llm, prompt, 256 // k)
            tpot = run["tpot_ms"]
            replay = _replay_ms(runner)
            res.setdefault(f"{name}_tpot", []).append(tpot)
            res.setdefault(f"{name}_replay", []).append(replay["ms"] if replay else float("nan"))
            print(json.dumps({"round": r, "mode": name, "tpot_ms": tpot, "tpot_p50_ms": run["tpot_p50_ms"],
                              "slow_gaps": run["slow_gaps"]["count"], "replay": replay}), flush=True)
    return {key: round(statistics.median(v), 3) for key, v in res.items()}


def tput(llm: Any, knob: Knob, prompts: list[Any], params: list[Any], rounds: int, warm: bool) -> dict[str, Any]:
    """The workload's output tok/s under each value, `rounds` times in rotation (after one warm-up run)."""
    runner = llm.executor.runner
    if warm:
        gen(llm, prompts, params)  # every eager token count and graph of the workload seen once
    rates: dict[str, list[float]] = {knob.label(v): [] for v in knob.values}
    for r in range(rounds):
        for value in rotation(knob.values, r):
            name = knob.label(value)
            switch(runner, knob, value, capture_all=True)
            gen(llm, prompts[:16], params[:16])  # the new variants compile outside the timed run
            _, elapsed, tokens = gen(llm, prompts, params)
            rates[name].append(tokens / elapsed)
            print(json.dumps({"round": r, "knob": name, "elapsed_s": round(elapsed, 3),
                              "output_tok_s": round(tokens / elapsed, 1)}), flush=True)
    return {f"{k} median_tok_s": round(statistics.median(v), 1) for k, v in rates.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b", choices=("qwen3-0.6b", "llama-3.1-8b"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--knob", default=DEFAULT_KNOB, help="MODULE.NAME=V1,V2,... (Python literals)")
    ap.add_argument("--tput-prompts", type=int, default=0, help="llama: time N x 1024/1024 instead of batch 1")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    knob = Knob(args.knob)

    cfg = dict(PRESETS[args.preset])
    if args.smoke:
        cfg.update(QWEN_SMOKE_SHAPE, num_hidden_layers=2)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        llm = llm_for(cfg, Path(tmp), enable_prefix_caching=False)
    print(json.dumps({"init_s": round(time.perf_counter() - t0, 1)}), flush=True)
    vocab = cfg["vocab_size"]
    result: dict[str, Any] = {"preset": args.preset, "knob": args.knob}
    result["equal"] = equality(llm, knob, vocab, [1, 8] if args.smoke else [1, 8, 40, 130], 8 if args.smoke else 48)
    print(json.dumps(result["equal"]), flush=True)
    if args.preset == "llama-3.1-8b" and args.tput_prompts and not args.smoke:
        prompts, lens = llama_workload(vocab, args.tput_prompts)
        result["tput"] = tput(llm, knob, prompts, run_params(lens), args.rounds, warm=False)
    elif args.preset == "llama-3.1-8b" and not args.smoke:
        result["b1"] = llama_b1(llm, knob, vocab, args.rounds, 1)
    else:
        prompts, params = qwen_requests(vocab, 4 if args.smoke else 256, 8 if args.smoke else None)
        result["tput"] = tput(llm, knob, prompts, params, args.rounds, warm=True)
    print("RESULT", json.dumps(result), flush=True)
    return 0 if result["equal"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
