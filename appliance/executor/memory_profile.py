"""What the KV cache may take on a GPU: the bytes other engines of the process hold, and the peak of this runner's
largest step (its weights and activations), measured by running that step once on a temporary cache."""
from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import torch

from appliance.engine.config import StepTokens
from appliance.engine.sampling_params import SamplingParams
from appliance.executor import kv_cache
from appliance.executor.input_batch import Chunk, build_inputs
from appliance.executor.request_table import RequestState

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig
    from appliance.executor.model_runner import ModelRunner


def allocated_by_others(device: torch.device) -> int:
    """Bytes this process holds on the device before a runner allocates anything (another engine of a test or
    benchmark): not part of that runner's peak. Dropped engines are collected first."""
    if device.type != "cuda":
        return 0
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated(device)


def peak_bytes(model: torch.nn.Module, config: ApplianceConfig, spec: kv_cache.KVCacheSpec, step_tokens: StepTokens,
               device: torch.device, baseline: int) -> int:
    """Peak GPU memory of the largest step (the largest chunk of one request, StepTokens.largest_chunk, plus
    max_num_seqs logit rows): the model's weights and activations, less `baseline` (allocated_by_others)."""
    sched = config.scheduler
    tokens = step_tokens.largest_chunk
    blocks = (tokens + spec.block_size - 1) // spec.block_size
    temp = kv_cache.allocate(spec, blocks, device)
    layers = model.attention_layers()  # type: ignore[operator]
    for layer, (k, v) in zip(layers, temp):
        layer.bind_kv_cache(k, v)
    state = RequestState("profile", [0] * tokens, tokens, 0, list(range(blocks)), SamplingParams())
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        inputs = build_inputs([Chunk(state, 0, tokens, True)], spec.block_size, device,
                              with_states=bool(getattr(model, "state_layers", lambda: [])()))
        hidden = model(inputs.input_ids, inputs.positions, inputs.meta)
        # a verification samples up to 1 + num_steps rows per request (accepted drafts + the bonus)
        rows = min(sched.max_num_seqs * (1 + (config.speculative.num_steps
                                              if config.speculative.algorithm is not None else 0)), tokens)
        model.compute_logits(hidden[:rows]).float().softmax(-1)  # type: ignore[operator]
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    for layer in layers:
        layer.bind_kv_cache(None, None)
    del temp, hidden
    torch.cuda.empty_cache()
    # the temporary cache was part of the peak; the real cache replaces it
    return peak - blocks * spec.bytes_per_block - baseline


def count_blocks(runner: ModelRunner) -> int:
    """How many KV blocks the runner allocates: cache.max_total_tokens, else what the memory budget leaves."""
    cache = runner.config.cache
    if cache.max_total_tokens is not None:
        return kv_cache.blocks_from_tokens(cache.max_total_tokens, runner.block_size)
    if runner.device.type != "cuda":
        return kv_cache.blocks_for_cpu(runner.kv_spec, runner.max_model_len, runner.config.scheduler.max_num_seqs)
    peak = peak_bytes(runner.model, runner.config, runner.kv_spec, runner.step_tokens, runner.device,
                      runner._mem_baseline)
    return kv_cache.blocks_for_gpu(runner.kv_spec, runner.device, cache.gpu_memory_utilization, peak)
