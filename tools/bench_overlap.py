"""Overlap scheduling against the synchronous loop on one GPU, on one model in one process.

    python3 tools/bench_overlap.py qwen          # Qwen3-0.6B shape: 256 seqs, in/out uniform [100, 1024], seed 0
    python3 tools/bench_overlap.py llama [N]     # Llama-3.1-8B shape: batch 1 (1024 in / 256 out); N x 1024/1024

Both first check that the two loops give the same tokens (greedy batch of 8 with CUDA graphs; a mixed batch of
greedy, seeded, penalised and logprobs rows, which take the host path). The loop is switched on the same LLM
(`llm.engine.overlap`), so both modes share weights, graphs and compiled kernels. Dummy weights, bf16, sampling
as in `vllm bench` (temperature 1.0, top_p 1.0, ignore_eos). Prints one JSON line per figure, then RESULT.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_offline import PRESETS
from gpu_measure import qwen_requests


def llm_for(cfg: dict, tmp: Path, **kw: object):
    from appliance import LLM

    (tmp / "config.json").write_text(json.dumps(cfg))
    return LLM(model=str(tmp), load_format="dummy", dtype="bfloat16", seed=0, skip_tokenizer_init=True, **kw)


def gen(llm, prompts: list, params) -> tuple[list, float, int]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    el = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return outs, el, n


def main() -> None:
    from appliance import SamplingParams

    which = sys.argv[1]
    res = {}
    cfg = PRESETS["qwen3-0.6b" if which == "qwen" else "llama-3.1-8b"]
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        llm = llm_for(cfg, Path(tmp), enable_prefix_caching=False)
        res["init_s"] = round(time.perf_counter() - t, 1)
    rng = random.Random(0)
    V = cfg["vocab_size"]
    # correctness: greedy b8 (graphs) overlap vs sync, and a mixed batch (greedy + random + seeded + penalty)
    prompts = [{"prompt_token_ids": [rng.randrange(V) for _ in range(rng.randint(16, 600))]} for _ in range(8)]
    g = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    got = {}
    for ov in (False, True):
        llm.engine.overlap = ov
        got[ov] = [o.outputs[0].token_ids for o in llm.generate(prompts, g)]
    res["greedy_b8_overlap_eq_sync"] = sum(a == b for a, b in zip(got[False], got[True]))
    mixed = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.0, repetition_penalty=1.2, max_tokens=24, ignore_eos=True),
             SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)] * 2
    for ov in (False, True):
        llm.engine.overlap = ov
        got[ov] = [o.outputs[0].token_ids for o in llm.generate(prompts, mixed)]
    res["mixed_b8_overlap_eq_sync"] = sum(a == b for a, b in zip(got[False], got[True]))
    print(json.dumps(res), flush=True)
    if which == "qwen":
        prompts, params = qwen_requests(V, 256)
        for ov in (True, False, True):
            llm.engine.overlap = ov
            _, el, nt = gen(llm, prompts, params)
            res.setdefault(f"qwen256_tok_s_overlap={ov}", []).append(round(nt / el, 1))
            print(json.dumps(res), flush=True)
    else:
        prompt = [rng.randrange(V) for _ in range(1024)]
        for ov in (False, True, False, True):
            llm.engine.overlap = ov
            eng = llm.engine
            eng.add_request(f"b1-{ov}-{time.monotonic_ns()}", prompt,
                            SamplingParams(temperature=1.0, top_p=1.0, max_tokens=256, ignore_eos=True))
            times = []
            while eng.has_work():
                t = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t)
            res.setdefault(f"b1_tpot_ms_overlap={ov}", []).append(round(statistics.median(times[3:]) * 1e3, 3))
            print(json.dumps(res), flush=True)
        if len(sys.argv) > 2:
            n = int(sys.argv[2])
            prompts = [{"prompt_token_ids": [rng.randrange(V) for _ in range(1024)]} for _ in range(n)]
            params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=1024, ignore_eos=True)
            llm.engine.overlap = True
            _, el, nt = gen(llm, prompts, params)
            res[f"llama_{n}x1024_tok_s_overlap"] = round(nt / el, 1)
            res[f"llama_{n}_elapsed"] = round(el, 1)
    print("RESULT", json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
