"""The disk tier's I/O in runs (executor/disk_file.py): a plan's spills and fetches grouped into runs of
consecutive disk and host slots, each run one positioned write or read per cache tensor, with the same bytes as
block-by-block I/O on random plans of every cache dtype."""
from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tier_fixtures import Caches, assert_same_bits, random_host

from appliance.engine.disk_tier import FETCH, SPILL
from appliance.executor.disk_file import DiskFile, DiskRun, disk_runs
from appliance.executor.host_copy import HostCopier, Inline
from appliance.executor.kv_cache import KVCacheSpec


def test_runs_follow_consecutive_slots_on_both_sides_in_plan_order() -> None:
    ops = [(SPILL, 4, 0), (SPILL, 5, 1), (SPILL, 6, 2),  # ascending
           (SPILL, 9, 7), (SPILL, 8, 6),  # descending, turned ascending
           (SPILL, 2, 3), (SPILL, 3, 5),  # the host slot skips: two runs
           (FETCH, 4, 3), (FETCH, 5, 4),  # a fetch of a slot just spilled: its own run, after the spills
           (SPILL, 1, 1)]
    assert disk_runs(ops) == [DiskRun(SPILL, 4, 0, 3), DiskRun(SPILL, 8, 6, 2), DiskRun(SPILL, 2, 3, 1),
                              DiskRun(SPILL, 3, 5, 1), DiskRun(FETCH, 4, 3, 2), DiskRun(SPILL, 1, 1, 1)]
    with pytest.raises(ValueError, match="spills and fetches"):
        disk_runs([(0, 1, 1)])


def copier(host: Caches, disk: DiskFile) -> HostCopier:
    device = [(torch.zeros_like(k), None if v is None else torch.zeros_like(v)) for k, v in host]
    return HostCopier(device, host, Inline(), disk)


def counting(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    calls: list[int] = []
    real: Callable[..., Any] = getattr(os, name)

    def call(*args: Any) -> Any:
        calls.append(args[-1])  # the offset
        return real(*args)

    monkeypatch.setattr(os, name, call)
    return calls


def test_a_run_is_one_write_or_read_per_tensor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    host = random_host(spec, 8, torch.Generator().manual_seed(5))
    want = [t[1:5].clone() for pair in host for t in pair if t is not None]
    disk = DiskFile(str(tmp_path), host, num_slots=6)
    writes, reads = counting(monkeypatch, "pwrite"), counting(monkeypatch, "preadv")
    tiers = copier(host, disk)
    tiers.submit([(SPILL, 2 + i, 1 + i) for i in range(4)])
    assert len(writes) == 6 and not reads  # 4 blocks x 6 tensors, in 6 writes
    assert writes == [base + 2 * size for base, size in zip(disk.bases, disk.block_bytes, strict=True)]
    tiers.submit([(FETCH, 5 - i, 7 - i) for i in range(4)])  # a descending run into slots 4..7
    assert len(reads) == 6 and len(writes) == 6
    got = [t[4:8] for pair in host for t in pair if t is not None]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def per_block_reference(host: Caches, disk_slots: int, ops: list[tuple[int, int, int]]) -> None:
    """The plan block by block on an in-memory disk: what the file must hold, whatever its layout."""
    store = [torch.zeros((disk_slots, *t.shape[1:]), dtype=torch.uint8 if t.element_size() == 1 else t.dtype)
             for pair in host for t in pair if t is not None]
    tensors = [t.view(torch.uint8) if t.element_size() == 1 else t for pair in host for t in pair if t is not None]
    for direction, d, h in ops:
        for disk, t in zip(store, tensors, strict=True):
            (disk[d].copy_(t[h]) if direction == SPILL else t[h].copy_(disk[d]))


def random_plan(rng: random.Random, disk_slots: int, host_slots: int) -> list[tuple[int, int, int]]:
    ops: list[tuple[int, int, int]] = []
    for _ in range(30):
        n = rng.randint(1, 4)
        d, h = rng.randrange(disk_slots - n + 1), rng.randrange(host_slots - n + 1)
        direction = rng.choice((SPILL, FETCH))
        run = [(direction, d + i, h + i) for i in range(n)]
        ops += run[::-1] if rng.random() < 0.3 else run
    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_random_plans_in_runs_give_the_bytes_of_per_block_io(tmp_path: Path, dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    rng = random.Random(11)
    for trial in range(4):
        ops = random_plan(rng, disk_slots=10, host_slots=9)
        assert len(disk_runs(ops)) < len(ops)  # the plan has multi-block runs
        grouped, blockwise, reference = (random_host(spec, 9, torch.Generator().manual_seed(trial)) for _ in range(3))
        in_runs, one_by_one = DiskFile(str(tmp_path), grouped, 10), DiskFile(str(tmp_path), blockwise, 10)
        copier(grouped, in_runs).submit(ops)
        for direction, d, h in ops:
            (one_by_one.spill if direction == SPILL else one_by_one.fetch)(d, h)
        size = 10 * in_runs.slot_bytes
        assert os.pread(in_runs.fd, size, 0) == os.pread(one_by_one.fd, size, 0)
        in_runs.close()
        one_by_one.close()
        per_block_reference(reference, 10, ops)
        assert_same_bits(grouped, reference, (trial, dtype))
        assert_same_bits(blockwise, reference, (trial, dtype))
