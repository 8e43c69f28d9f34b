#!/usr/bin/env python3
"""Programmatic dependent launch (kernels/triton/common.py) on and off in one process, alternating: greedy tokens
must not change, and the Llama-3.1-8B batch-1 step / the Qwen3-0.6B throughput run say what it is worth.

    python3 tools/lab_pdl.py --preset llama-3.1-8b [--rounds 2]
    python3 tools/lab_pdl.py --preset qwen3-0.6b [--rounds 2]
    python3 tools/lab_pdl.py --smoke          # a tiny Qwen3 on any device (the harness only)

Each switch rebuilds the runner's decode graphs (a graph keeps the launches it captured) and, with
--capture-all, captures every size before timing. Prints one JSON line per measure, then RESULT.
"""
from __future__ import annotations

import argparse
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
from gpu_measure import QWEN_SMOKE_SHAPE, _replay_ms, _tpot, qwen_requests


def switch(runner: Any, pdl: bool, capture_all: bool = False) -> float:
    """PDL on or off, decode graphs rebuilt; returns the seconds it took."""
    import torch

    from appliance.kernels.triton import common

    t = time.perf_counter()
    common.PDL = pdl
    runner.graphs = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    runner.graphs = runner._make_graphs()
    if capture_all:
        runner.capture_graphs(2048)
    return time.perf_counter() - t


def greedy(llm: Any, prompts: list[dict[str, list[int]]], n: int) -> list[list[int]]:
    from appliance import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp)]


def equality(llm: Any, vocab: int, batches: list[int], n: int) -> dict[str, Any]:
    """Greedy tokens with PDL on vs off for several batch sizes (GEMV and cuBLAS paths, split and unsplit
    decode): any race between launches would show as a different token."""
    rng = random.Random(5)
    out: dict[str, Any] = {}
    runner = llm.executor.runner
    for b in batches:
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(20, 300))]}
                   for _ in range(b)]
        got = {}
        for pdl in (True, False):
            switch(runner, pdl)
            got[pdl] = greedy(llm, prompts, n)
        same = sum(x == y for x, y in zip(got[True], got[False]))
        out[f"b{b}"] = f"{same}/{b}"
    out["ok"] = all(v == f"{b}/{b}" for b, v in zip(batches, out.values()))
    return out


def llama_b1(llm: Any, vocab: int, rounds: int, k: int) -> dict[str, Any]:
    runner = llm.executor.runner
    rng = random.Random(2)
    prompt = [rng.randrange(vocab) for _ in range(1024 // k)]
    res: dict[str, list[float]] = {}
    for r in range(rounds):
        for name, pdl in ((("on", True), ("off", False)) if r % 2 == 0 else (("off", False), ("on", True))):
            switch(runner, pdl)
            _tpot(llm, prompt, 8)  # captures the graph this key uses
            tpot = _tpot(llm, prompt, 256 // k)["tpot_ms"]
            replay = _replay_ms(runner)
            res.setdefault(f"{name}_tpot", []).append(tpot)
            res.setdefault(f"{name}_replay", []).append(replay["ms"] if replay else float("nan"))
            print(json.dumps({"round": r, "mode": name, "tpot_ms": tpot, "replay": replay}), flush=True)
    return {key: round(statistics.median(v), 3) for key, v in res.items()}


def qwen_tput(llm: Any, cfg: dict[str, Any], rounds: int, smoke: bool) -> dict[str, Any]:

    runner = llm.executor.runner
    prompts, params = qwen_requests(cfg["vocab_size"], 4 if smoke else 256, 8 if smoke else None)
    gen(llm, prompts, params)  # warm: every eager token count and graph of the workload seen once
    rates: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(rounds):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            switch(runner, name == "on", capture_all=True)
            gen(llm, prompts[:16], params[:16])  # the new variants compile outside the timed run
            _, elapsed, tokens = gen(llm, prompts, params)
            rates[name].append(tokens / elapsed)
            print(json.dumps({"round": r, "pdl": name, "elapsed_s": round(elapsed, 3),
                              "output_tok_s": round(tokens / elapsed, 1)}), flush=True)
    return {f"{k}_median_tok_s": round(statistics.median(v), 1) for k, v in rates.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b", choices=("qwen3-0.6b", "llama-3.1-8b"))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()

    cfg = dict(PRESETS[args.preset])
    if args.smoke:
        cfg.update(QWEN_SMOKE_SHAPE, num_hidden_layers=2)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        llm = llm_for(cfg, Path(tmp), enable_prefix_caching=False)
    print(json.dumps({"init_s": round(time.perf_counter() - t0, 1)}), flush=True)
    vocab = cfg["vocab_size"]
    result: dict[str, Any] = {"preset": args.preset}
    result["equal"] = equality(llm, vocab, [1, 8] if args.smoke else [1, 8, 40, 130], 8 if args.smoke else 48)
    print(json.dumps(result["equal"]), flush=True)
    if args.preset == "llama-3.1-8b" and not args.smoke:
        result["b1"] = llama_b1(llm, vocab, args.rounds, 1)
    else:
        result["tput"] = qwen_tput(llm, cfg, args.rounds, args.smoke)
    print("RESULT", json.dumps(result), flush=True)
    return 0 if result["equal"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
