"""benchmarks/tier_copies.py: agentic sessions over a small device pool and a host tier, the fake executor checking
every position a request reads; the tier's copies must come as long runs over consecutive host slots, a few
calls per cache tensor for many blocks (a copy per run of consecutive (block, slot) pairs was ~1 per block)."""
from __future__ import annotations

import pytest
import torch

from appliance.executor.kv_cache import KVCacheSpec
from benchmarks.tier_copies import (
    CopyCounts,
    Shape,
    drive,
    gpu_submit,
    pair_runs,
    time_submit,
)


def test_sessions_reload_their_histories_in_few_calls_per_block() -> None:
    core = drive(Shape(sessions=8, turns=4, system=128, user=32, output=32, tool=96, pool_tokens=2048,
                       think_steps=10), check_kv=True)
    host = core.scheduler.cache.host
    assert host is not None and host.num_loaded > 100 and host.num_stored > 100
    plans = [p.host_copies for p in core.executor.plans]
    c = CopyCounts.of(plans)
    assert c.blocks == host.num_loaded + host.num_stored
    assert c.runs * 6 < c.blocks  # host-slot runs of 6+ blocks on average
    assert c.calls * 5 < c.blocks and c.calls * 3 < c.pair_runs
    time_submit(max(plans, key=len), 2048 // 16, 4 * 2048 // 16)  # issues them on CPU tensors


def test_pair_runs_counts_runs_consecutive_in_block_and_slot() -> None:
    assert pair_runs([(0, 4, 0), (0, 5, 1), (0, 7, 2), (1, 8, 3), (1, 9, 4)]) == 3


def test_the_gpu_timing_runs_on_the_cpu_with_a_tiny_cache(capsys: pytest.CaptureFixture[str]) -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=8, block_size=16, dtype=torch.bfloat16)
    gpu_submit(torch.device("cpu"), spec, num_blocks=64, num_slots=100, histories=2, history=20)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and all("40 blocks" in x for x in lines)
