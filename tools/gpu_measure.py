"""Measuring helpers of tools/bench_gpu.py: model construction, greedy equality, throughput, per-token time,
graph replay and GEMV timings, weight bytes. Kept apart from the sections and the report so each file holds one
concept; bench_gpu.py adds this folder to sys.path.
"""
from __future__ import annotations

import json
import os
import random
import statistics
import threading
import time
from typing import Any

from step_diagnostics import GcPauses, HostCounters, StepPhases, device_allocs

TINY = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 4096,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_theta": 10000.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}
# shrinks the Qwen3-0.6B preset for --smoke runs of the Qwen3 tools (bench_runs, bench_steps) on any device
QWEN_SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                    "head_dim": 16, "vocab_size": 512}
OVERLAP = True  # the product's default; --no-overlap: every LLM built here runs the synchronous loop


# ---- helpers used inside sections -----------------------------------------------------------------------------
class Recorder:
    """Accumulates a section's results and rewrites its JSON file after every entry."""

    def __init__(self, path: Path) -> None:
        self.path, self.data = path, {}

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.path.write_text(json.dumps(self.data, indent=1))
        print(f"  {key}: {value}", flush=True)


def _llm(cfg: dict[str, Any], tmp: Path, **overrides: Any) -> Any:
    from appliance import LLM

    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(cfg))
    overrides.setdefault("enable_overlap_schedule", OVERLAP)
    return LLM(model=str(tmp), load_format="dummy", dtype="bfloat16", seed=0, skip_tokenizer_init=True,
               **overrides)


def _prompts(rng: random.Random, vocab: int, lens: list[int]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(n)]} for n in lens]


def qwen_workload(vocab: int, n: int = 256, k: int = 1, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """The issue's Qwen3 throughput workload: n sequences whose prompt and output lengths are uniform in
    [100, 1024] (divided by k for smoke runs), random token ids below vocab; (prompts, output lengths)."""
    rng = random.Random(seed)
    in_lens = [rng.randint(100 // k, 1024 // k) for _ in range(n)]
    out_lens = [rng.randint(100 // k, 1024 // k) for _ in range(n)]
    return [[rng.randrange(vocab) for _ in range(m)] for m in in_lens], out_lens


def qwen_requests(vocab: int, n: int, max_out: int | None = None) -> tuple[list[dict[str, list[int]]], list[Any]]:
    """qwen_workload as generate() takes it: n prompts and their SamplingParams (temperature 1, ignore_eos);
    max_out caps the output lengths (smoke runs)."""
    ids, out_lens = qwen_workload(vocab, n)
    return ([{"prompt_token_ids": p} for p in ids],
            run_params(out_lens if max_out is None else [min(m, max_out) for m in out_lens]))


def run_params(out_lens: list[int]) -> list[Any]:
    """The throughput runs' SamplingParams: random sampling (temperature 1), ignore_eos, one per output length."""
    from appliance import SamplingParams

    return [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=m, ignore_eos=True) for m in out_lens]


def recipe_step_budget(name: str) -> int:
    """scheduler.chunked_prefill_size of the shipped recipe `name`: the 8B runs as its recipe deploys it
    (recipes/llama-3.1-8b.toml: 640, docs/benchmarks.md fifteenth run)."""
    import tomllib

    from appliance.config.recipes import recipe_path

    return int(tomllib.loads(recipe_path(name).read_text())["scheduler"]["chunked_prefill_size"])


def llama_workload(vocab: int, n: int, k: int = 1, seed: int = 0) -> tuple[list[dict[str, list[int]]], list[int]]:
    """The issue's 8B throughput workload: n prompts of 1024 random token ids below vocab, 1024 output tokens each
    (both divided by k for smoke runs); (prompts, output lengths)."""
    return _prompts(random.Random(seed), vocab, [1024 // k] * n), [1024 // k] * n


def _greedy_equal(llm: Any, rng: random.Random, vocab: int, n: int, lens: list[int]) -> dict[str, Any]:
    """Greedy tokens with graphs, then eagerly on the same model (prefix cache off so both compute alike)."""
    from appliance import SamplingParams

    runner = llm.executor.runner
    prompts = _prompts(rng, vocab, lens)
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    runner.use_graphs = True
    a = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    graphs = len(runner.graphs.graphs) if runner.graphs is not None else 0
    runner.use_graphs = False
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    runner.use_graphs = True
    same = sum(x == y for x, y in zip(a, b))
    first_diff = [next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), None) for x, y in zip(a, b)]
    return {"sequences_identical": f"{same}/{len(a)}", "ok": same == len(a), "graphs_captured": graphs,
            "first_mismatch_positions": first_diff, "tokens_per_seq": n}


def _throughput(llm: Any, prompts: list[dict[str, list[int]]], out_lens: list[int]) -> dict[str, float]:
    params = run_params(out_lens)
    # time inside executor.execute (runner host work + GPU) vs the rest of engine.step (scheduler only: the GPU
    # idles then, the loop being synchronous); with overlap, execute runs on the step thread beside the scheduler,
    # so the difference means nothing and is left out
    execute, step = llm.executor.execute, llm.engine.step
    acc = {"execute": 0.0, "step": 0.0, "steps": 0}

    def timed_execute(plan: Any) -> Any:
        t = time.perf_counter()
        try:
            return execute(plan)
        finally:
            acc["execute"] += time.perf_counter() - t

    def timed_step() -> Any:
        t = time.perf_counter()
        try:
            return step()
        finally:
            acc["step"] += time.perf_counter() - t
            acc["steps"] += 1

    llm.executor.execute, llm.engine.step = timed_execute, timed_step
    preempted = llm.engine.scheduler.num_preemptions
    t0 = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.executor.execute, llm.engine.step = execute, step
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    steps = max(acc["steps"], 1)
    return {"elapsed_s": round(elapsed, 2), "output_tokens": n_out, "output_tok_s": round(n_out / elapsed, 1),
            "steps": acc["steps"], "ms_per_step": round(elapsed / steps * 1e3, 3),
            "overlap": bool(llm.engine.overlap), "preemptions": llm.engine.scheduler.num_preemptions - preempted,
            "scheduler_ms_per_step": None if llm.engine.overlap else round((acc["step"] - acc["execute"]) / steps * 1e3,
                                                                           3),
            "outside_engine_ms_per_step": round((elapsed - acc["step"]) / steps * 1e3, 3)}


def _tpot(llm: Any, prompt: list[int], out_len: int, stacks: bool | None = None) -> dict[str, Any]:
    """Time to the first token and the gaps between the later tokens of one request alone, taken when each token
    reaches the caller: in overlap mode a step() returns the previous step's token, so step wall times would
    shift the prefill into the first "decode" interval. Also: the gaps that lift the mean off the median, with the
    engine phases of their steps; with APPLIANCE_B1_STACKS=1 the main thread's stacks during slow submits."""
    from appliance import SamplingParams

    eng = llm.engine
    rid = f"b1-{time.monotonic_ns()}"
    allocs = device_allocs()
    stacks = os.environ.get("APPLIANCE_B1_STACKS") == "1" if stacks is None else stacks
    phases = StepPhases(eng, stacks)
    host = HostCounters()
    pauses = GcPauses()
    start = time.perf_counter()
    eng.add_request(rid, prompt, SamplingParams(temperature=1.0, top_p=1.0, max_tokens=out_len, ignore_eos=True))
    arrivals: list[float] = []
    steps = 0
    try:
        with phases:
            while eng.has_work():
                deltas = eng.step()
                steps += 1
                now = time.perf_counter()
                arrivals += [now] * sum(len(d.new_token_ids) for d in deltas)
    finally:
        gc_pauses = pauses.stop()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    p50 = statistics.median(gaps)
    slow = [(i, round(g * 1e3, 2)) for i, g in enumerate(gaps) if g > 1.2 * p50]  # what lifts the mean off p50
    return {"ttft_ms": round((arrivals[0] - start) * 1e3, 2), "tpot_ms": round(statistics.mean(gaps) * 1e3, 3),
            "tpot_p50_ms": round(p50 * 1e3, 3), "tpot_max_ms": round(max(gaps) * 1e3, 3),
            "slow_gaps": {"count": len(slow), "first": slow[:8],
                          "phases_ms": [[phases.at(j) for j in (i, i + 1, i + 2)] for i, _ in slow[:3]]},
            "phases_p50_ms": phases.median(),
            **({"slow_submit_stacks": phases.slow_submit_stacks()} if stacks else {}),
            "gc": gc_pauses, "host": host.stop(), "py_threads": [t.name for t in threading.enumerate()],
            "device_allocs": {k: v - allocs.get(k, 0) for k, v in device_allocs().items()}, "steps": steps}


def replay_ms(replay: Any, reps: int, after: Any = None) -> float:
    """Median ms of `replay()` over reps calls, CUDA events around each; `after()` runs between them untimed."""
    import torch

    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        if after is not None:
            after()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_call_us(call: Any, copies: int, reps: int = 5) -> float:
    """Per-call microseconds of `call(i)` for i over `copies` (weight copies that exceed L2, so each call reads
    HBM), captured in one CUDA graph after two warm-up calls: median of `reps` replays, divided by the copies."""
    import torch

    for i in range(min(2, copies)):
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            call(i)
    return round(replay_ms(graph.replay, reps) * 1e3 / copies, 2)


def _replay_ms(runner: Any) -> Any:
    """GPU time of the last decode graph replayed, on its last inputs (median of 20, CUDA events): the step
    time without the host's share (input building, sampling, scheduling)."""
    import torch

    graphs = runner.graphs
    if graphs is None or graphs.last_key is None or not torch.cuda.is_available():
        return None
    replay = graphs.graphs[graphs.last_key]
    lens = runner.block_table.lens
    saved = lens.clone()  # each replay advances its rows' positions (executor/cuda_graph.py): put them back
    return {"key": str(graphs.last_key), "ms": round(replay_ms(replay, 20, lambda: lens.copy_(saved)), 3)}


def _gemv_ms(model: Any) -> Any:
    """Batch-1 time of the weight matrices alone, every layer's own (as the layers run them: the bound GEMV
    kernel or cuBLAS), replayed from a CUDA graph: how much of a decode step the GEMVs take versus the floor."""
    import torch

    if not torch.cuda.is_available():
        return None
    layers = model.model.layers
    mods = [m for layer in layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                            layer.mlp.gate_up_proj, layer.mlp.down_proj)] + [model.lm_head]
    w0 = mods[0].weight
    x = {m.weight.shape[1]: torch.randn(1, m.weight.shape[1], dtype=w0.dtype, device=w0.device) for m in mods}
    graph = torch.cuda.CUDAGraph()
    with torch.inference_mode():
        for m in mods[:5]:
            m(x[m.weight.shape[1]])
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for m in mods:
                m(x[m.weight.shape[1]])
    kernel = "triton gemv" if getattr(mods[0], "gemv", None) is not None else "cublas"
    return {"ms": round(replay_ms(graph.replay, 10), 3), "note": f"every layer's matrices + lm_head ({kernel})"}


def _weight_bytes(model: Any) -> int:
    """Bytes one decode step reads: every parameter, except an untied input embedding (only rows are read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not getattr(model, "tie_word_embeddings", False):
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total

