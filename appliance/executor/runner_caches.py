"""What a ModelRunner holds its requests' state in, built once at start-up: the KV cache (sized by the memory
profile), the device block tables, the state cache of hybrid models, the sliding layers' pools and the host and
disk tiers, each bound to its layers."""
from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING

import torch

from appliance.executor import kv_cache, window_groups
from appliance.executor.host_copy import HostCopier
from appliance.executor.kv_scales import setup as kv_scale_setup
from appliance.executor.memory_profile import count_blocks
from appliance.executor.request_table import DeviceBlockTable
from appliance.executor.startup import STARTUP
from appliance.executor.state_cache import make_state_cache
from appliance.executor.window_table import WindowDeviceTables
from appliance.kernels.reference.kv_quant import is_fp8

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig
    from appliance.executor.kv_scales import CheckpointKVScales
    from appliance.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)


def build_caches(runner: ModelRunner, config: ApplianceConfig, layers: list[torch.nn.Module],
                 kv_scales: CheckpointKVScales) -> None:
    """Set the runner's caches and tables. The profile measures the step with the tables and state cache already
    allocated, so the KV budget leaves room for them."""
    kv_dtype = kv_cache.kv_cache_dtype(config.precision.kv_cache_dtype, runner.dtype)
    high = kv_cache.high_precision_layers(config.precision.kv_cache_high_precision_layers,
                                          len(runner.model.attention_layers()))
    runner.kv_spec = kv_cache.KVCacheSpec.of(layers, runner.block_size, kv_dtype, high, runner.dtype)
    if is_fp8(kv_dtype):  # before the profile binds a cache
        runner.kv_scale_source = kv_scale_setup(config, runner.model, layers, kv_scales)
    elif kv_scales.scales:
        log.info("the checkpoint ships fp8 KV cache scales; a %s cache does not use them (they apply with "
                 "precision.kv_cache_dtype = fp8)", kv_dtype)
    runner.max_blocks = -(-runner.max_model_len // runner.block_size)
    # one row per request the scheduler may run at once (prefilling ones included; speculative decoding adds
    # rows to no request)
    runner.block_table = DeviceBlockTable(config.scheduler.max_num_seqs, runner.max_blocks, runner.device,
                                          "torch" if runner.backend == "torch" else None)
    # hybrid models: per-request recurrent states beside the KV cache, one slot per table row (state_cache.py)
    runner.state_cache = make_state_cache(runner, config.scheduler.max_num_seqs)
    # sliding layers in pools of their own where the run allows (window_groups.py), tables on the device too
    sliding = window_groups.sliding_groups(runner)
    runner.window_table = WindowDeviceTables(len(sliding), runner.block_table) if sliding else None
    with STARTUP.phase("profiling memory"):
        runner.kv_layout = window_groups.split(count_blocks(runner), runner.kv_spec, sliding,
                                               runner.max_model_len, runner.step_tokens.largest_chunk)
        runner.num_blocks = runner.kv_layout.num_blocks
    with STARTUP.phase("allocating the KV cache"):
        runner.kv_caches = kv_cache.allocate(runner.kv_spec, runner.num_blocks, runner.device,
                                             runner.kv_layout.layer_blocks(runner.kv_spec.num_layers),
                                             runner.kv_layout.positions(runner.kv_spec.num_layers))
    weakref.finalize(runner, kv_cache.release, runner.kv_caches)  # the memory goes with the runner
    for layer, (k, v) in zip(layers, runner.kv_caches):
        layer.bind_kv_cache(k, v)
    runner.kv_layout.bind_groups(layers)
    # the host tier (cache.host_cache) and the disk tier behind it, and their copies (host_copy.py)
    copier = HostCopier.build(config.cache, runner.kv_spec, runner.num_blocks, runner.kv_caches, runner.device)
    copier.bind_layers(layers)
    runner.host_copier = copier
    runner.host_kv, runner.num_host_blocks = copier.host_caches, copier.num_host_slots
    runner.num_disk_blocks = copier.num_disk_slots
