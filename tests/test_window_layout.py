"""executor/window_groups.py and kv_cache.allocate: when the sliding-window groups share the full group's KV pool
(groups of one size, a 16-bit cache), the pool's size from the budget, each layer's position, and the tensors the
layers at one position share; otherwise separate pools split from the budget."""
from __future__ import annotations

import torch

from appliance.engine.kv_groups import KVGroup
from appliance.executor import kv_cache
from appliance.executor.window_groups import shareable, split

CPU = torch.device("cpu")


def spec(layers: int, dtype: torch.dtype = torch.bfloat16) -> kv_cache.KVCacheSpec:
    return kv_cache.KVCacheSpec(num_layers=layers, num_kv_heads=2, head_dim=16, block_size=16, dtype=dtype)


def test_groups_of_the_full_groups_size_share_one_pool() -> None:
    # six layers, two global (2 and 5) and four local in two groups of two: the layout of Gemma 3 at 1 : 2
    sliding = (KVGroup(8, (0, 1)), KVGroup(8, (3, 4)))
    s = spec(6)
    assert shareable(sliding, s) == KVGroup(None, (2, 5))
    layout = split(100, s, sliding, 256, 64)
    # the budget of 100 blocks of six layers is 300 blocks of two: one per position of a group
    assert layout.shared and layout.num_blocks == 300 and layout.window_blocks == (0, 0)
    assert layout.layer_blocks(6) == [300] * 6
    assert layout.positions(6) == [0, 1, 0, 0, 1, 1]
    caches = kv_cache.allocate(s, layout.num_blocks, CPU, layout.layer_blocks(6), layout.positions(6))
    assert caches[0][0] is caches[2][0] is caches[3][0] and caches[1][1] is caches[4][1] is caches[5][1]
    assert caches[0][0] is not caches[1][0] and caches[0][0].shape[0] == 300


def test_separate_pools_where_the_groups_cannot_share() -> None:
    sliding = (KVGroup(8, (0, 1, 3)),)  # three local layers, two global: no groups of one size
    assert shareable(sliding, spec(5)) is None
    layout = split(100, spec(5), sliding, 256, 64)
    assert not layout.shared and layout.positions(5) is None and 1 < layout.window_blocks[0] < layout.num_blocks
    caches = kv_cache.allocate(spec(5), layout.num_blocks, CPU, layout.layer_blocks(5))
    assert len({id(k) for k, _ in caches}) == 5 and caches[0][0].shape[0] == layout.window_blocks[0]
    # an fp8 cache: online calibration rescales a layer's whole tensor, which sharing would corrupt
    fp8, pairs = spec(6, torch.float8_e4m3fn), (KVGroup(8, (0, 1)), KVGroup(8, (3, 4)))
    assert shareable(pairs, fp8) is None and shareable(pairs, spec(6)) is not None
    assert not split(100, fp8, pairs, 256, 64).shared
