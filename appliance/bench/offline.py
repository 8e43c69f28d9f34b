"""The offline runners: `throughput` (a whole workload through LLM.generate) and `latency` (batches run alone,
timed as each token reaches the caller), both on an `appliance.LLM` in this process."""
from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from appliance.bench.report import RequestTiming, stats_ms, throughput_metrics, timing_metrics
from appliance.bench.workloads import Workload

LATENCY_PERCENTILES = (10, 25, 50, 75, 90, 99)  # vLLM's `bench latency` percentiles of the batch latency


def sampling(max_tokens: int, temperature: float) -> Any:
    """A benchmark request's SamplingParams: EOS ignored, so it produces exactly max_tokens tokens."""
    from appliance import SamplingParams

    return SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens, ignore_eos=True)


def capture_graphs(llm: Any, max_context: int) -> int:
    """Capture the decode graphs a run up to max_context tokens uses before it is timed (else the first steps that
    meet a new context width capture one); 0 where the executor has no in-process runner or no graphs."""
    runner = getattr(llm.executor, "runner", None)
    return runner.capture_graphs(max_context) if runner is not None else 0


def warm_up(llm: Any, workload: Workload, temperature: float) -> float:
    """A few short requests first: every kernel variant a step meets is compiled before the timed run."""
    t = time.perf_counter()
    n = min(16, len(workload.prompts))
    llm.generate([{"prompt_token_ids": p} for p in workload.prompts[:n]], sampling(8, temperature))
    return time.perf_counter() - t


def throughput(llm: Any, workload: Workload, temperature: float = 1.0, progress: bool = False) -> dict[str, Any]:
    """Every prompt of the workload submitted at once; the rates over the whole run (vLLM's `bench throughput`)."""
    params = [sampling(m, temperature) for m in workload.output_lens]
    steps_before = llm.engine.stats().num_steps
    preempted_before = llm.engine.scheduler.num_preemptions
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params, use_tqdm=progress)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = throughput_metrics(elapsed, len(outs), workload.input_tokens, n_out)
    result.update(steps=llm.engine.stats().num_steps - steps_before,
                  preemptions=llm.engine.scheduler.num_preemptions - preempted_before,
                  max_num_seqs=llm.engine.config.max_num_seqs, num_blocks=llm.engine.config.num_blocks)
    return result


def run_batch(llm: Any, prompts: Sequence[list[int]], output_len: int, temperature: float) -> list[RequestTiming]:
    """One batch alone on the engine: every token's arrival time as step() hands it over (in overlap mode a step
    returns the previous step's tokens, so step wall times would shift the prefill into the first gap). The heap
    is frozen meanwhile, as LLM.generate freezes it: a full collection pass would land in some token's time."""
    from appliance.runtime.gc_heap import frozen_heap

    engine = llm.engine
    ids = [f"bench-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
    arrivals: dict[str, list[float]] = {rid: [] for rid in ids}
    with frozen_heap():
        start = time.perf_counter()
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, list(prompt), sampling(output_len, temperature))
        while engine.has_work():
            deltas = engine.step()
            now = time.perf_counter()
            for d in deltas:
                if d.request_id in arrivals:
                    arrivals[d.request_id] += [now] * len(d.new_token_ids)
    timings = []
    for rid, prompt in zip(ids, prompts):
        t = arrivals[rid]
        timings.append(RequestTiming(success=bool(t), prompt_len=len(prompt), output_tokens=len(t),
                                     ttft=t[0] - start if t else 0.0, latency=t[-1] - start if t else 0.0,
                                     itl=[b - a for a, b in zip(t, t[1:])], error="" if t else "no output"))
    return timings


def latency(llm: Any, workload: Workload, batch_size: int, num_iters: int, num_iters_warmup: int,
            temperature: float = 1.0, percentiles: Sequence[float] = (99,),
            progress: bool = False) -> dict[str, Any]:
    """vLLM's `bench latency`: batches of batch_size requests run one after another, each alone; the batch
    latencies (avg_latency, percentiles) and, per token, TTFT / TPOT / ITL. Every batch gets fresh prompts (no
    prefix-cache hits): the workload holds (num_iters_warmup + num_iters) * batch_size of them."""
    need = (num_iters_warmup + num_iters) * batch_size
    if len(workload.prompts) < need or num_iters < 1:
        raise ValueError(f"latency needs num_iters >= 1 and {need} prompts, the workload has {len(workload.prompts)}")
    output_len = max(workload.output_lens)
    batches = [workload.prompts[i:i + batch_size] for i in range(0, need, batch_size)]
    for batch in batches[:num_iters_warmup]:
        run_batch(llm, batch, output_len, temperature)
    timed = batches[num_iters_warmup:]
    if progress:
        from tqdm import tqdm

        timed = tqdm(timed, desc="latency", unit="batch")
    latencies: list[float] = []
    timings: list[RequestTiming] = []
    for batch in timed:
        batch_timings = run_batch(llm, batch, output_len, temperature)
        latencies.append(max(t.latency for t in batch_timings))
        timings += batch_timings
    result = timing_metrics(timings, sum(latencies), percentiles)
    result.update(avg_latency=statistics.mean(latencies), latencies=latencies, batch_size=batch_size,
                  percentiles={str(p): float(v) for p, v in zip(
                      LATENCY_PERCENTILES, _percentiles(latencies, LATENCY_PERCENTILES))})
    result.update(stats_ms("latency", latencies, percentiles))
    return result


def _percentiles(values: Sequence[float], ps: Sequence[float]) -> list[float]:
    import numpy as np

    return list(np.percentile(np.asarray(values, dtype=float), ps))
