"""The runner's warm-up: what a run would otherwise pay on first use, paid before the first request.

On a GPU the first launch of a kernel variant costs milliseconds: Triton compiles (or loads) each specialisation,
cuBLAS chooses a kernel per problem shape and CUDA loads each kernel's module lazily, and pinned staging buffers
are allocated on first use. Steps that meet these in the middle of a run stall the host, and the overlapped loop
then leaves the device idle: without the warm-up, the first Qwen3 throughput run of a process spent 279 ms
more host time in `linear` (the LM head meeting new row counts), plus first uses of the step's gathers, scatters and
stagers. (Triton variants an earlier start listed are meanwhile compiled ahead in other processes, executor/
compile_ahead.py: the warm-up finds those in the cache.) So the warm-up runs:
- a prefill for every padded sequence count (the Triton prefill kernel's variants, input_batch.padded_count), with
  draft trees (speculative.eagle_topk > 1) also as tree verifications (the kernel's variants with a tree mask);
- the GPU sampler at 1, 2 and 16 rows (Triton specialises integer arguments equal to 1 and divisible by 16);
- the LM head at each row count it runs on (the decode graphs' capture sizes: ModelRunner.logits);
- the decode graphs (contexts up to graph_context) and the piecewise token buckets;
- real steps through `launch` / `finish`, overlapped like a run: a prefill, a decode reading the ids still in
  flight (a graph replay), and a mixed step (the pieces, the eager pending-id path, a gathered LM head).
Everything writes only block 0 (of every KV pool: a sliding-window group's block 0 is its null block, which no
query reads) and no request outlives the warm-up.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.engine.step import NewRequestData, ScheduledRequest, StepPlan
from appliance.executor.cuda_graph import GRAPH_CONTEXT
from appliance.executor.draft_tree import DraftTree
from appliance.executor.input_batch import Chunk
from appliance.executor.piecewise import all_buckets
from appliance.executor.request_table import RequestState
from appliance.executor.startup import STARTUP

if TYPE_CHECKING:
    from appliance.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)

SAMPLER_ROWS = (1, 2, 16)
STEP_TOKENS = 4  # the most a request of the warm-up's steps holds: a 2-token prompt and two decodes


def warm_up(runner: ModelRunner, graph_context: int = GRAPH_CONTEXT) -> float:
    """Run everything above; returns the seconds taken. It writes KV into block 0: call it before serving (the
    runner's constructor does), never with blocks cached. Each part is a start-up phase (executor/startup.py)
    that counts its items: "capturing decode graphs 37/140"."""
    start = time.perf_counter()
    took: dict[str, float] = {}
    tick = STARTUP.advance

    def timed(name: str, phase: str, total: int, run: Callable[[], int | None]) -> int | None:
        t = time.perf_counter()
        with STARTUP.phase(phase, total), torch.inference_mode():
            out = run()
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
        took[name] = time.perf_counter() - t
        return out

    counts = _prefill_counts(runner)
    graphs, pieces = runner.graphs, runner.pieces
    graph_keys = graphs.keys_up_to(min(graph_context, runner.max_model_len)) if graphs is not None else []
    sizes = graphs.sizes if graphs is not None else []
    samplers = len(SAMPLER_ROWS) if runner.batch_sampler.gpu_op is not None else 0
    timed("prefills", "compiling prefill kernels", len(counts), lambda: _prefills(runner, counts, tick))
    timed("sampler", "compiling the sampler", samplers, lambda: _sampler(runner, tick))
    timed("LM head", "warming the LM head", len(sizes), lambda: _logit_rows(runner, tick))
    count = timed("decode graphs", "capturing decode graphs", len(graph_keys),
                  lambda: runner.capture_graphs(graph_context, tick))
    buckets = timed("piecewise buckets", "capturing piecewise buckets",
                    len(all_buckets(pieces.max_tokens)) if pieces is not None else 0,
                    lambda: pieces.capture_all(tick) if pieces is not None else 0)
    timed("steps", "warm-up steps", 0, lambda: _steps(runner))
    total = time.perf_counter() - start
    log.info("warm-up: %s decode graphs (batch sizes %s, up to %d tokens of context) and %s piecewise token buckets "
             "captured, kernels compiled, in %.1f s (%s)", count, _span(sizes),
             min(graph_context, runner.max_model_len), buckets, total,
             ", ".join(f"{k} {v:.1f} s" for k, v in took.items()))
    return total


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]} ({len(sizes)})" if sizes else "none"


def _prefill_counts(runner: ModelRunner) -> list[int]:
    """1, 2, 4, ... sequences, up to the most a step prefills at two tokens each."""
    most = max(1, min(runner.config.scheduler.max_num_seqs, runner.step_tokens.budget // 2))
    counts = [1]
    while counts[-1] < most:
        counts.append(min(2 * counts[-1], most))
    return counts


def _prefills(runner: ModelRunner, counts: list[int], tick: Callable[[], None]) -> None:
    """Two tokens per sequence, all in block 0 (no request holds it yet); with draft trees, again as a root and one
    node per sequence."""
    s = runner.config.speculative
    trees = [None] + ([DraftTree((0,), (-1,))] if s.algorithm is not None and s.eagle_topk > 1 else [])
    for n in counts:
        for tree in trees:
            states = [RequestState(f"warmup{i}", [0, 0], 2, 0, [0, 0], SamplingParams(),
                                   window_tables=_window_tables(runner, 2)) for i in range(n)]
            inputs = runner.host_inputs([Chunk(st, 0, 2, False, tree) for st in states])
            runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        tick()


def _window_tables(runner: ModelRunner, num_blocks: int) -> list[list[int]]:
    """A warm-up request's table in each sliding-window KV cache group: block 0 throughout."""
    return [[0] * num_blocks for _ in runner.kv_layout.groups]


def _sampler(runner: ModelRunner, tick: Callable[[], None]) -> None:
    op = runner.batch_sampler.gpu_op
    if op is None:
        return
    vocab = int(runner.hf_config.vocab_size)
    for m in SAMPLER_ROWS:
        logits = torch.randn(m, vocab, dtype=runner.dtype, device=runner.device)
        temperature = (torch.arange(m, device=runner.device) % 2).float()  # greedy and random rows
        i = torch.zeros(m, dtype=torch.int64, device=runner.device)
        op(logits, temperature, i, torch.ones(m, device=runner.device), torch.zeros(m, device=runner.device), i, i)
        tick()


def _logit_rows(runner: ModelRunner, tick: Callable[[], None]) -> None:
    """The LM head runs eagerly after every step on the rows it samples, padded to a decode graph's capture size
    (ModelRunner.logits): one GEMM per size. (Warming every row count 1..256 instead took the 8B's warm-up from
    26.5 to 40.3 s on an H100.)"""
    if runner.graphs is None:
        return
    sizes = runner.graphs.sizes
    hidden = torch.randn(sizes[-1], int(runner.hf_config.hidden_size), dtype=runner.dtype, device=runner.device)
    for m in sizes:
        runner.logits(hidden, list(range(m)))
        tick()


def _steps(runner: ModelRunner) -> None:
    """A prefill of up to three 2-token prompts, a decode of them (their inputs still in flight), then a mixed step
    (those decodes and one more prompt), launched back to back and finished; the requests are then dropped. As
    many requests as the block table holds (max_num_seqs; one request: no mixed step). Random sampling only where
    the GPU sampler takes it, so no host generator is consumed; the per-request noise seeds drawn here are given
    back. Skipped when a request cannot hold STEP_TOKENS tokens (max_model_len)."""
    if runner.max_model_len < STEP_TOKENS:
        return
    greedy = SamplingParams(temperature=0.0).to_dict()
    rand = SamplingParams(temperature=1.0).to_dict() if runner.batch_sampler.gpu_op is not None else greedy
    capacity = runner.block_table.num_free
    k = min(3, max(1, capacity - 1))  # decoding requests; one row left for the mixed step's prompt
    blocks = [0] * -(-STEP_TOKENS // runner.block_size)  # every position in block 0, whatever the block size
    new = [NewRequestData(f"warmup-step{i}", [0, 0], 2, 0, blocks, rand if i % 2 else greedy,
                          window_block_ids=_window_tables(runner, len(blocks)))
           for i in range(min(k + 1, capacity))]
    ids = [r.request_id for r in new]
    plans = [StepPlan(0, new[:k], [ScheduledRequest(r, 2, [], True) for r in ids[:k]]),
             StepPlan(1, [], [ScheduledRequest(r, 1, [], True) for r in ids[:k]])]
    if len(new) > k:
        plans.append(StepPlan(2, new[k:], [ScheduledRequest(r, 1, [], True) for r in ids[:k]]
                              + [ScheduledRequest(ids[k], 2, [], True)]))
    with runner.noise_seeds_kept():
        try:
            handles = [runner.launch(plan) for plan in plans]
            for handle in handles:
                runner.finish(handle)
        finally:
            runner.flush()
            for rid in ids:
                runner.requests.pop(rid, None)
