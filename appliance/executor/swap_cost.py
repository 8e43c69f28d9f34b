"""Measures, at start-up, the rates scheduler.preemption_mode = "auto" prices a swap with (engine/swap.py).

Copy bandwidth: a round trip of blocks between the device cache and the host tier's slots through the runner's
own copy path (block_copies.copy_host_blocks), the same per-run copies a swap runs. Prefill rate: one
chunk of the step's size from position 0 and one at a long context (all in block 0, which no request holds
yet), so the cost of recomputing n tokens has a per-token and a per-token-of-context term. Each is the best
of a few runs after one that pays first-use costs; the device is synchronised here only, before serving. The
timed prefill runs eagerly (a served one may replay piecewise graphs, a little faster), which leans toward swap.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from appliance.engine.sampling_params import SamplingParams
from appliance.engine.swap import SwapCosts
from appliance.executor import block_copies
from appliance.executor.input_batch import Chunk
from appliance.executor.request_table import RequestState

if TYPE_CHECKING:
    from appliance.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)

COPY_BLOCKS = 256  # blocks of the copy round trip, at most (and at most the host tier / the pool)
PREFILL_TOKENS = 512  # the timed chunk, at most (and at most the step budget)
CONTEXT_TOKENS = 32768  # the long context of the second timed chunk, at most (and what max_model_len leaves)
RUNS = 3


def wanted(runner: ModelRunner) -> bool:
    """Only preemption_mode auto prices swaps, and only where the engine can swap (a host tier; no recurrent
    state, no drafter: EngineConfig refuses those with its own message)."""
    return (runner.config.scheduler.preemption_mode == "auto" and runner.num_host_blocks > 0
            and runner.state_cache is None and runner.config.speculative.algorithm is None)


def measure(runner: ModelRunner) -> SwapCosts:
    n = max(1, min(COPY_BLOCKS, runner.num_host_blocks, runner.num_blocks))
    copies = [(0, b, b) for b in range(n)] + [(1, b, b) for b in range(n)]
    copy_s = _best(runner.device, lambda: block_copies.copy_host_blocks(runner.kv_caches, runner.host_kv, copies))
    gbps = 2 * n * runner.kv_spec.bytes_per_block / copy_s / 1e9
    t = max(1, min(PREFILL_TOKENS, runner.step_tokens.budget, runner.max_model_len // 2))
    context = min(CONTEXT_TOKENS, runner.max_model_len - t)
    short = _best(runner.device, lambda: _prefill(runner, 0, t))
    long = _best(runner.device, lambda: _prefill(runner, context, t))
    costs = SwapCosts(gbps, t / short, t, runner.kv_spec.bytes_per_block,
                      max(0.0, (long - short) / (t * context)) if context else 0.0)
    log.info("preemption costs measured: host <-> device copies %.2f GB/s (%d blocks of %d bytes, both ways), "
             "prefill %.0f tokens/s (%d tokens at position 0), %.3g s more per token and token of context (at %d)",
             gbps, n, runner.kv_spec.bytes_per_block, costs.prefill_tok_s, t, costs.context_s_per_token2, context)
    return costs


def _prefill(runner: ModelRunner, start: int, num_tokens: int) -> None:
    total = start + num_tokens
    blocks = [0] * (-(-total // runner.block_size))
    state = RequestState("swap-cost", [0] * total, total, start, blocks, SamplingParams())
    inputs = runner.host_inputs([Chunk(state, start, num_tokens, False)])
    with torch.inference_mode():
        runner.model(inputs.input_ids, inputs.positions, inputs.meta)


def _best(device: torch.device, fn: Callable[[], None]) -> float:
    """The fastest of RUNS timed calls after an untimed one."""
    best = float("inf")
    for i in range(RUNS + 1):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return max(best, 1e-9)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
