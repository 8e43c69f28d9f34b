"""executor/block_copies.py's host-tier copies on random caches, against one plain copy per block and tensor."""
from __future__ import annotations

import random

import pytest
import torch
from tier_fixtures import (
    assert_same_bits,
    assert_stored_then_loaded,
    cuda_caches,
    random_host,
)

from appliance.executor.block_copies import (
    CopyPlan,
    HostRun,
    copy_host_blocks,
    host_runs,
)
from appliance.executor.kv_cache import KVCacheSpec, allocate_host


def test_runs_follow_consecutive_host_slots_either_way_in_plan_order() -> None:
    ops = [(0, 4, 0), (0, 5, 1), (0, 6, 2), (0, 9, 3), (1, 10, 4), (1, 11, 5), (0, 12, 6), (1, 3, 1),
           (0, 8, 9), (0, 7, 8), (0, 20, 7), (1, 30, 2), (1, 30, 3), (1, 2, 5), (1, 2, 4)]
    assert host_runs(ops) == [
        HostRun(0, 0, (4, 5, 6, 9), False), HostRun(1, 4, (10, 11), True), HostRun(0, 6, (12,), True),
        HostRun(1, 1, (3,), True),
        HostRun(0, 7, (20, 7, 8), False),  # descending slots, turned ascending with their blocks
        HostRun(1, 2, (30,), True), HostRun(1, 3, (30,), True),  # a block loaded twice: the later must win
        HostRun(1, 5, (2,), True), HostRun(1, 4, (2,), True)]
    assert [r.calls for r in host_runs(ops)[:2]] == [2, 1]
    assert [len(r.blocks) for r in host_runs([(0, b, 10 - b) for b in range(5)], max_len=2)] == [2, 2, 1]
    # a chain evicted tail first into descending slots is one range copy
    assert host_runs([(0, 12, 5), (0, 11, 4), (0, 10, 3)]) == [HostRun(0, 3, (10, 11, 12), True)]
    with pytest.raises(ValueError, match="direction 2"):
        host_runs([(2, 0, 0)])


def reference(dev: list, host: list, ops: list[tuple[int, int, int]]) -> tuple[list, list]:
    """One copy per block and tensor, in plan order, on clones."""
    ref_dev = [(k.clone(), v.clone()) for k, v in dev]
    ref_host = [(k.clone(), v.clone()) for k, v in host]
    for d, b, s in ops:
        for (dk, dv), (hk, hv) in zip(ref_dev, ref_host, strict=True):
            for x, h in ((dk, hk), (dv, hv)):
                if d == 0:
                    h[s] = x[b]
                else:
                    x[b] = h[s]
    return ref_dev, ref_host


def random_plan(rng: random.Random, num_blocks: int, num_slots: int) -> list[tuple[int, int, int]]:
    """Runs of consecutive slots (either way) on consecutive or scattered blocks, singles, and reuse of blocks
    and slots across runs (a store then a load of the same block, a load then a store into the same slot)."""
    ops: list[tuple[int, int, int]] = []
    while len(ops) < 60:
        d, n = rng.randrange(2), rng.randrange(1, 9)
        s0 = rng.randrange(num_slots - n)
        slots = list(range(s0, s0 + n))
        if rng.random() < 0.3:
            slots.reverse()
        b0 = rng.randrange(num_blocks - n)
        blocks = list(range(b0, b0 + n)) if rng.random() < 0.5 else rng.sample(range(num_blocks), n)
        ops.extend((d, b, s) for b, s in zip(blocks, slots))
    return ops


def check_random_plans(spec: KVCacheSpec, trials: int, seed: int, device: torch.device) -> None:
    """copy_host_blocks on random plans over 24 device blocks and 20 host slots of random values, against
    reference(); the device caches drawn on the host, then moved to device."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)

    def rand(n: int) -> torch.Tensor:
        return torch.randn(n, spec.block_size, spec.num_kv_heads, spec.head_dim, generator=gen).to(spec.dtype)

    for _ in range(trials):
        dev_host = [(rand(24), rand(24)) for _ in range(spec.num_layers)]
        host = random_host(spec, 20, gen, device)
        ops = random_plan(rng, 24, 20)
        ref_dev, ref_host = reference(dev_host, host, ops)
        if device.type == "cpu":
            assert CopyPlan.of(ops, device).calls_per_tensor < len(ops)
        dev = [(k.to(device), v.to(device)) for k, v in dev_host]
        copy_host_blocks(dev, host, ops)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert_same_bits([(k.cpu(), v.cpu()) for k, v in dev] + host, ref_dev + ref_host)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_random_plans_match_one_copy_per_block_in_order(dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype=dtype)
    check_random_plans(spec, trials=20, seed=0, device=torch.device("cpu"))


def test_copies_match_one_copy_per_block_in_order() -> None:
    gen = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    dev = [(torch.randn(12, 4, 2, 8, generator=gen), torch.randn(12, 4, 2, 8, generator=gen)) for _ in range(3)]
    host = allocate_host(spec, 8, torch.device("cpu"))
    assert len(host) == 3 and host[0][0].shape == (8, 4, 2, 8)
    # stores (a run and a single), a load of a slot stored in the same plan, then that slot overwritten
    ops = [(0, 2, 0), (0, 3, 1), (0, 4, 2), (0, 7, 5), (1, 9, 1), (1, 10, 2), (0, 0, 1)]
    ref_dev, ref_host = reference(dev, host, ops)
    copy_host_blocks(dev, host, ops)
    assert_same_bits(dev + host, ref_dev + ref_host)
    assert torch.equal(dev[1][0][9], dev[1][0][3]) and not torch.equal(host[1][0][1], dev[1][0][3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copies_on_cuda_from_pinned_memory_in_stream_order() -> None:
    # stores then loads of the same slots in one plan, and a kernel writing a block right after its store: the
    # host must see the block before the write, the device the host's bytes after the load (no host waits)
    spec, dev = cuda_caches()
    host = allocate_host(spec, 32, torch.device("cuda"))
    assert host[0][0].is_pinned()
    before = [(k[0:8].cpu(), v[0:8].cpu()) for k, v in dev]
    copy_host_blocks(dev, host, [(0, b, b) for b in range(8)])
    for k, v in dev:  # the step's forward would rewrite them
        k[0:8].zero_()
        v[0:8].zero_()
    copy_host_blocks(dev, host, [(1, 40 + b, b) for b in range(8)])
    torch.cuda.synchronize()
    assert_stored_then_loaded(dev, before, host)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_random_plans_on_cuda_match_one_copy_per_block(dtype: torch.dtype) -> None:
    # scattered runs go through a device gather / scatter beside one pinned-memory copy, on the current stream
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    check_random_plans(spec, trials=5, seed=1, device=torch.device("cuda"))
