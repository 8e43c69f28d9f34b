"""One model's phase through vLLM's offline LLM (the child process of benchmarks/peer_models.py). Standard library
at import time; vllm and torch are imported by the functions that run it (so the CPU tests import this module)."""
from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

from benchmarks.peer_models import BASE_ENGINE, WORKLOAD, tpot_ms

WARMUP_PROMPTS, WARMUP_TOKENS = 16, 8  # ours: appliance/bench/offline.py warm_up


def make_llm(model_dir: Path, engine: dict[str, Any], **extra: Any) -> Any:
    # a callable sent to the workers (kv_facts) is pickled; vLLM accepts that only with this set
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM

    return LLM(model=str(model_dir), **BASE_ENGINE, **engine, **extra)


def params(max_tokens: int, delta: bool = False) -> Any:
    """Greedy, EOS ignored (every request makes exactly max_tokens), no detokenizer (there is no tokenizer)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                          output_kind=kind)


def arrivals(llm: Any, prompt: list[int], output_len: int) -> list[float]:
    """One request alone on the engine: each token's arrival time as LLMEngine.step hands it over (ours:
    appliance/bench/offline.py run_batch)."""
    engine = llm.llm_engine
    engine.add_request(f"b1-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params(output_len, delta=True))
    times: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            times += [time.perf_counter()] * len(out.outputs[0].token_ids)
    if len(times) != output_len:
        raise RuntimeError(f"asked for {output_len} tokens, the stream gave {len(times)}")
    return times


def batch1(llm: Any, spec: dict[str, Any]) -> tuple[float, str]:
    """Mean TPOT of the timed prompt after the warm-up one. Where stepping the engine fails, the difference of two
    runs, (T(n tokens) - T(1 token)) / (n - 1), as the peer kit measures; the method is returned beside it."""
    warm, timed = spec["prompts"]
    n = spec["output_len"]
    try:
        arrivals(llm, warm, n)
        return tpot_ms(arrivals(llm, timed, n)), "token arrival times"
    except Exception as e:  # noqa: BLE001 - the fallback's record names what failed
        method = f"difference of runs (stepping failed: {type(e).__name__}: {e})"
    llm.generate([{"prompt_token_ids": warm}], params(n), use_tqdm=False)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": timed}], params(1), use_tqdm=False)
    t1 = time.perf_counter() - t
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": timed}], params(n), use_tqdm=False)
    return (time.perf_counter() - t - t1) / (n - 1) * 1e3, method


def throughput(llm: Any, spec: dict[str, Any], warm_up: bool) -> dict[str, Any]:
    """Every prompt at once (ours: offline.throughput, after offline.warm_up where warm_up)."""
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    if warm_up:
        llm.generate(prompts[:WARMUP_PROMPTS], params(WARMUP_TOKENS), use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, [params(n) for n in spec["output_lens"]], use_tqdm=False)
    seconds = time.perf_counter() - t
    made = sum(len(o.outputs[0].token_ids) for o in outs)
    if made != sum(spec["output_lens"]):
        raise RuntimeError(f"asked for {sum(spec['output_lens'])} tokens, got {made}")
    return {"num_prompts": len(prompts), "input_len": spec["input_len"], "output_len": spec["output_len"],
            "seconds": seconds, "output_tok_s": made / seconds, "preemptions": None}


def engine_name() -> str:
    import vllm

    return f"vllm {vllm.__version__}"


def device_name() -> str:
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def measure_models(model_dir: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    from benchmarks.peer_kv import kv_facts, kv_per_sequence, kv_pools

    config = json.loads((model_dir / "config.json").read_text())
    engine = spec["engine"]
    llm = make_llm(model_dir, engine)
    tokens = spec["throughput"]["input_len"] + spec["throughput"]["output_len"]
    try:  # the speed figures stand without it: a worker that cannot answer leaves the KV cell with its reason
        facts = llm.collective_rpc(kv_facts)[0]
        backend, kv = ",".join(facts["attention_backends"]) or None, kv_per_sequence(facts, spec["kv_context"])
        pools = kv_pools(facts, tokens)
    except Exception as e:  # noqa: BLE001 - reported in the record
        backend, kv = None, {"error": f"{type(e).__name__}: {e}"}
        pools = dict(kv)
    quant = (config.get("quantization_config") or {}).get("quant_method")
    record: dict[str, Any] = {"model": spec["model"], "engine": engine_name(),
                              "settings": {**engine, "dtype": BASE_ENGINE["dtype"], "quantization": quant},
                              "backend": backend, "device": device_name(),
                              "cuda_graphs": not engine.get("enforce_eager", False), "kv_per_sequence": kv,
                              "kv_pools": pools}
    record["batch1_decode_ms_per_token"], record["batch1_method"] = batch1(llm, spec["batch1"])
    record["throughput"] = throughput(llm, spec["throughput"], warm_up=True)
    return [record]


def first_token(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """A one-token request alone on the engine: seconds from its submission to the token's arrival from
    LLMEngine.step, and the prompt tokens the prefix cache reused (ours: hybrid.second_turn, offline.run_batch)."""
    engine, rid = llm.llm_engine, f"mt-{time.monotonic_ns()}"
    start = time.perf_counter()
    engine.add_request(rid, {"prompt_token_ids": prompt}, params(1, delta=True))
    arrival, cached = None, 0
    try:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if arrival is None and out.outputs[0].token_ids:
                    arrival = time.perf_counter()
                cached = getattr(out, "num_cached_tokens", None) or cached
    except Exception:
        engine.abort_request([rid])  # a later generate must not run it too
        raise
    if arrival is None:
        raise RuntimeError("the one-token request made no token")
    return arrival - start, cached


def generate_ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """first_token's figures from a one-token generate's wall time (where stepping the engine fails)."""
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params(1), use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens or 0


def multi_turn(llm: Any, spec: dict[str, Any]) -> tuple[list[float], int, str]:
    """The warm-up session untimed, then per session the first turn and the second (its prompt, its answer and the
    new tokens) for one token: each second turn's time to first token in ms, the prefix-cache hits of the timed
    sessions' requests and the method (ours: hybrid.shared_prefix_ttft). Where stepping the engine fails in the
    warm-up session, every second turn is a one-token generate's wall time, and the method says so."""
    second, method = first_token, "token arrival times"

    def session(first: list[int], tail: list[int]) -> tuple[float, int]:
        out = llm.generate([{"prompt_token_ids": first}], params(spec["answer"]), use_tqdm=False)[0]
        ttft, cached = second(llm, first + list(out.outputs[0].token_ids) + tail)
        return ttft * 1e3, (out.num_cached_tokens or 0) + cached

    try:
        session(*spec["warmup"])
    except Exception as e:  # noqa: BLE001 - the record names what failed
        second, method = generate_ttft, f"generate wall time (stepping failed: {type(e).__name__}: {e})"
        session(*spec["warmup"])  # the warm-up again, through the fallback
    timed = [session(first, tail) for first, tail in zip(spec["firsts"], spec["tails"])]
    return [t for t, _ in timed], sum(h for _, h in timed), method


def measure_hybrid(model_dir: Path, spec: dict[str, Any], phase: str) -> list[dict[str, Any]]:
    snapshots = phase == "snapshots"
    llm = make_llm(model_dir, spec["engine"], enable_prefix_caching=snapshots)
    cache = llm.llm_engine.vllm_config.cache_config
    shape = {"model": spec["model"], "engine": engine_name(), "layers": spec["layers"], "device": device_name(),
             "gated_delta": "vllm", "decode_graphs": not spec["engine"].get("enforce_eager", False)}
    records = []
    if not snapshots:
        b1 = spec["batch1"]
        tpot, method = batch1(llm, b1)
        records.append({**shape, "metric": "batch1_decode", "tpot_ms": round(tpot, 3), "method": method,
                        "input_len": len(b1["prompts"][0]), "output_len": b1["output_len"]})
        tput = throughput(llm, spec["throughput"], warm_up=False)
        records.append({**shape, "metric": "throughput", "output_tok_s": round(tput["output_tok_s"], 1),
                        "num_prompts": tput["num_prompts"], "input_len": tput["input_len"],
                        "output_len": tput["output_len"], "wall_s": round(tput["seconds"], 2)})
    turns = spec["multi_turn"]
    ttfts, hits, method = multi_turn(llm, turns)
    records.append({**shape, "metric": "multi_turn_ttft", "snapshots": snapshots,
                    "mean_ttft_ms": round(statistics.mean(ttfts), 3),
                    "median_ttft_ms": round(statistics.median(ttfts), 3), "ttft_ms": [round(t, 3) for t in ttfts],
                    "turn_len": turns["turn_len"], "shared": turns["shared"], "sessions": len(turns["firsts"]),
                    "warmup_sessions": 1, "ttft_method": method, "prefix_hit_tokens": hits,
                    "checkpoint_interval": cache.mamba_block_size if snapshots else None,
                    "mamba_cache_mode": cache.mamba_cache_mode})
    return records


def measure(model_dir: Path, phase: str) -> list[dict[str, Any]]:
    spec = json.loads((model_dir / WORKLOAD).read_text())
    if spec["kind"] == "models":
        return measure_models(model_dir, spec)
    return measure_hybrid(model_dir, spec, phase)
