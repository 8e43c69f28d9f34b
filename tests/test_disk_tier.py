"""The disk tier behind the host tier: executor/disk_file.py's spills and fetches on random host slots of every
cache dtype, the copier's order around them, and through the offline API on a small random model (CPU) a host
tier smaller than the device pool whose dropped blocks come back from disk, token-exact with a cold prefill."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tier_fixtures import Recording, assert_same_bits, llm_args, random_host, turns

from appliance import LLM
from appliance.config import build_config
from appliance.config.support import check_supported
from appliance.engine.disk_tier import FETCH, SPILL
from appliance.engine.host_tier import LOAD, STORE
from appliance.engine.sampling_params import SamplingParams
from appliance.executor.disk_file import DiskFile
from appliance.executor.host_copy import HostCopier, segments
from appliance.executor.kv_cache import KVCacheSpec, allocate_host


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_spills_and_fetches_round_trip_every_layer(tmp_path: Path, dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    host = random_host(spec, 6, torch.Generator().manual_seed(3))
    disk = DiskFile(str(tmp_path / "tier"), host, num_slots=5)
    assert os.fstat(disk.fd).st_size == 5 * disk.slot_bytes == 5 * spec.bytes_per_block
    assert not os.listdir(tmp_path / "tier")  # unlinked at once: nothing outlives the process
    want1, want2 = ([(k[i].clone(), v[i].clone()) for k, v in host] for i in (1, 2))
    disk.spill(4, 1)
    disk.spill(0, 2)
    for k, v in host:  # the host slots are reused meanwhile
        k[1:3].zero_()
        v[1:3].zero_()
    disk.fetch(0, 5)  # into another slot
    disk.fetch(4, 1)
    assert_same_bits([(k[1], v[1]) for k, v in host], want1)
    assert_same_bits([(k[5], v[5]) for k, v in host], want2)
    disk.close()
    assert disk.fd == -1


def test_disk_io_waits_for_the_copies_before_it_in_plan_order(tmp_path: Path) -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    gen = torch.Generator().manual_seed(4)
    dev = [(torch.randn(6, 4, 2, 8, generator=gen), torch.randn(6, 4, 2, 8, generator=gen)) for _ in range(2)]
    host = allocate_host(spec, 3, torch.device("cpu"))
    log: list[tuple[str, int]] = []
    copier = HostCopier(dev, host, Recording(log), DiskFile(str(tmp_path), host, 4))
    ops = [(STORE, 1, 0), (SPILL, 2, 0), (STORE, 3, 0), (FETCH, 2, 1), (LOAD, 5, 1)]
    assert [d for d, _ in segments(ops)] == [False, True, False, True, False]
    copier.submit(ops)
    # the store into slot 0 reaches disk before slot 0 is rewritten, and comes back through slot 1 into block 5
    assert torch.equal(dev[1][0][5], dev[1][0][1]) and torch.equal(host[0][0][0], dev[0][0][3])
    assert [e[0] for e in log] == ["begin"] + ["mark", "mark", "drain"] * 2 + ["mark", "mark"]


def test_the_disk_tier_needs_the_host_tier_a_directory_and_a_size(tmp_path: Path) -> None:
    for incomplete in (["cache.disk_cache=true", f"cache.disk_cache_dir={tmp_path}", "cache.disk_cache_size_gb=1"],
                       ["cache.host_cache=true", "cache.host_cache_storage_backend=file", "cache.disk_cache_size_gb=1"]):
        assert any(m.startswith("cache.disk_cache: the disk tier sits behind the host tier")
                   for m in check_supported(build_config(dotlist=incomplete))), incomplete
    ok = build_config(dotlist=["cache.host_cache=true", "cache.host_cache_storage_backend=file",
                               f"cache.disk_cache_dir={tmp_path}", "cache.disk_cache_size_gb=1",
                               "cache.host_cache_storage_prefetch_policy=wait_complete"])
    assert check_supported(ok) == []
    for other in ("cache.host_cache_storage_backend=mooncake", "cache.host_cache_storage_prefetch_policy=best_effort",
                  'cache.host_cache_storage_config={"file_path": "/x"}'):
        bad = build_config(dotlist=["cache.host_cache=true", other])
        assert any("storage backend is `file`" in m for m in check_supported(bad)), other


def test_blocks_the_host_drops_come_back_from_disk_token_exact(tiny_model: Path, tmp_path: Path) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    common = llm_args(tiny_model)
    tiered = LLM(**common, host_cache=True, host_cache_ratio=0.5, disk_cache=True, disk_cache_dir=str(tmp_path),
                 disk_cache_size_gb=0.01)
    host_only = LLM(**common, host_cache=True, host_cache_ratio=0.5)
    cold = LLM(**common, enable_prefix_caching=False)
    assert not list(tmp_path.iterdir()) and tiered.executor.runner.num_disk_blocks == tiered.engine.config.num_disk_blocks > 0
    cached, fewer = 0, 0
    for batch in turns():
        ours = tiered.generate(batch, greedy)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in cold.generate(batch, greedy)]
        cached += sum(o.num_cached_tokens for o in ours)
        fewer += sum(o.num_cached_tokens for o in host_only.generate(batch, greedy))
        assert tiered.engine.check_accounting().ok, tiered.engine.check_accounting().problems
    disk = tiered.engine.scheduler.cache.host.disk
    assert disk is not None and disk.num_spilled > 0 and disk.num_fetched > 0
    assert cached > fewer
