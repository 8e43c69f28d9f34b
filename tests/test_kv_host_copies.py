"""executor/kv_cache.py's host-tier copies on random caches, against one plain copy per block and tensor."""
from __future__ import annotations

import pytest
import torch

from appliance.executor.kv_cache import (
    KVCacheSpec,
    allocate_host,
    coalesce,
    copy_host_blocks,
)


def test_coalesce_joins_only_consecutive_runs_of_one_direction() -> None:
    ops = [(0, 4, 0), (0, 5, 1), (0, 6, 2), (0, 9, 3), (1, 10, 4), (1, 11, 5), (0, 12, 6), (1, 3, 1)]
    assert coalesce(ops) == [(0, 4, 0, 3), (0, 9, 3, 1), (1, 10, 4, 2), (0, 12, 6, 1), (1, 3, 1, 1)]


def test_copies_match_one_copy_per_block_in_order() -> None:
    gen = torch.Generator().manual_seed(0)
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    dev = [(torch.randn(12, 4, 2, 8, generator=gen), torch.randn(12, 4, 2, 8, generator=gen)) for _ in range(3)]
    host = allocate_host(spec, 8, torch.device("cpu"))
    assert len(host) == 3 and host[0][0].shape == (8, 4, 2, 8)
    # stores (a run and a single), a load of a slot stored in the same plan, then that slot overwritten
    ops = [(0, 2, 0), (0, 3, 1), (0, 4, 2), (0, 7, 5), (1, 9, 1), (1, 10, 2), (0, 0, 1)]
    ref_dev = [(k.clone(), v.clone()) for k, v in dev]
    ref_host = [(k.clone(), v.clone()) for k, v in host]
    for d, b, s in ops:
        for (dk, dv), (hk, hv) in zip(ref_dev, ref_host, strict=True):
            for x, h in ((dk, hk), (dv, hv)):
                if d == 0:
                    h[s] = x[b]
                else:
                    x[b] = h[s]
    copy_host_blocks(dev, host, ops)
    for got, want in zip(dev + host, ref_dev + ref_host, strict=True):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(dev[1][0][9], dev[1][0][3]) and not torch.equal(host[1][0][1], dev[1][0][3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copies_on_cuda_from_pinned_memory_in_stream_order() -> None:
    # stores then loads of the same slots in one plan, and a kernel writing a block right after its store: the
    # host must see the block before the write, the device the host's bytes after the load (no host waits)
    dev_type = torch.device("cuda")
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    dev = [(torch.randn(64, 16, 2, 64, device=dev_type, dtype=torch.bfloat16),
            torch.randn(64, 16, 2, 64, device=dev_type, dtype=torch.bfloat16)) for _ in range(2)]
    host = allocate_host(spec, 32, dev_type)
    assert host[0][0].is_pinned()
    before = [(k[0:8].cpu(), v[0:8].cpu()) for k, v in dev]
    copy_host_blocks(dev, host, [(0, b, b) for b in range(8)])
    for k, v in dev:  # the step's forward would rewrite them
        k[0:8].zero_()
        v[0:8].zero_()
    copy_host_blocks(dev, host, [(1, 40 + b, b) for b in range(8)])
    torch.cuda.synchronize()
    for (k, v), (bk, bv), (hk, hv) in zip(dev, before, host, strict=True):
        assert torch.equal(hk[0:8], bk) and torch.equal(hv[0:8], bv)
        assert torch.equal(k[40:48].cpu(), bk) and torch.equal(v[40:48].cpu(), bv)
