"""The worker's side of the sliding-window KV cache groups (engine/kv_groups.py): whether this runner gives its
sliding-window layers pools of their own, how the KV budget splits over the groups, and which cache each layer
binds. Eager steps, the decode graphs and the piecewise graphs carry the groups' tables (window_inputs.py,
window_table.py). Without sliding groups (a model without sliding layers, or a run whose other features do not
carry the groups' tables yet, logged) every layer keeps the whole context in the one pool, as before.

Where every window's layers divide into groups as large as the full group (Gemma 3: 8 global layers and 40 local
ones, five groups of 8; gpt-oss: 12 and 12), the groups share one pool, as vLLM's hybrid KV cache manager does:
layer i of every group uses the same K/V tensors, one block id is the same memory in any group, and the engine
hands each block to one group's table at a time (engine/window_blocks.py). The memory then goes where the running
requests need it; separate pools are split once, in proportion to a sequence of max_model_len
(kv_groups.plan_blocks), which fits one sequence length only. An fp8 cache keeps separate pools: online
calibration rescales a layer's whole cache tensor (executor/kv_calibration.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.engine.kv_groups import KVGroup, kv_groups, plan_blocks

if TYPE_CHECKING:
    from appliance.executor.kv_cache import KVCacheSpec
    from appliance.executor.model_runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WindowLayout:
    """The full group's blocks, and each sliding group with its pool's blocks (its null block included); with
    `shared`, one pool of num_blocks for every group (window_blocks all 0, as the engine reads them) and each
    layer's position in its group (`positions`), the K/V tensors it shares with that position of the others."""

    num_blocks: int
    groups: tuple[KVGroup, ...] = ()
    window_blocks: tuple[int, ...] = ()
    full: KVGroup | None = None  # the full-attention group, when shared

    @property
    def shared(self) -> bool:
        return self.full is not None

    def positions(self, num_layers: int) -> list[int] | None:
        """Each attention layer's index within its group (shared pools; None otherwise)."""
        if self.full is None:
            return None
        out = [0] * num_layers
        for g in (self.full, *self.groups):
            for j, i in enumerate(g.layers):
                out[i] = j
        return out

    @property
    def window_sizes(self) -> tuple[int, ...]:
        return tuple(g.window for g in self.groups if g.window is not None)

    def layer_blocks(self, num_layers: int) -> list[int]:
        """Blocks of each attention layer's cache (its group's pool; the one pool when shared)."""
        out = [self.num_blocks] * num_layers
        if self.shared:
            return out
        for g, n in zip(self.groups, self.window_blocks):
            for i in g.layers:
                out[i] = n
        return out

    def bind_groups(self, layers: list[Any]) -> None:
        """Point each sliding layer at its group's addresses (AttentionMetadata.windows[g - 1])."""
        for g, group in enumerate(self.groups, 1):
            for i in group.layers:
                layers[i].kv_group = g


def sliding_groups(runner: ModelRunner) -> tuple[KVGroup, ...]:
    """The sliding groups that get pools of their own: () unless the model has both layer kinds and nothing in
    this run needs one table for every layer yet."""
    groups = kv_groups([getattr(a, "sliding_window", None) for a in runner.model.attention_layers()])  # MLA: none
    sliding = tuple(g for g in groups if g.sliding)
    if not sliding or len(sliding) == len(groups):
        return ()
    c = runner.config
    why = [name for name, on in (
        ("speculative decoding", c.speculative.algorithm is not None),
        ("the host KV tier", c.cache.host_cache),
        ("recurrent state", runner.state_cache is not None),
        ("precision.kv_cache_high_precision_layers", bool(runner.kv_spec.high_precision_layers)),
    ) if on]
    if why:
        log.info("sliding-window layers keep the whole context in the shared KV pool: their own pools do not "
                 "work with %s yet", ", ".join(why))
        return ()
    k = len(next(g for g in groups if not g.sliding).layers)
    if _fp8(runner.kv_spec) or any(len(g.layers) % k for g in sliding):
        return sliding  # separate pools (see the module docstring)
    return tuple(KVGroup(g.window, g.layers[j : j + k]) for g in sliding for j in range(0, len(g.layers), k))


def _fp8(spec: KVCacheSpec) -> bool:
    return spec.dtype.itemsize == 1


def shareable(sliding: tuple[KVGroup, ...], spec: KVCacheSpec) -> KVGroup | None:
    """The full group, when the groups share one pool: every sliding group has its size (sliding_groups made
    them so) and the cache is not fp8."""
    if not sliding or _fp8(spec):
        return None
    in_sliding = {i for g in sliding for i in g.layers}
    full = KVGroup(None, tuple(i for i in range(spec.num_layers) if i not in in_sliding))
    return full if full.layers and all(len(g.layers) == len(full.layers) for g in sliding) else None


def split(num_blocks: int, spec: KVCacheSpec, sliding: tuple[KVGroup, ...], max_model_len: int,
          largest_chunk: int) -> WindowLayout:
    """The memory of `num_blocks` blocks of every layer, split over the groups in proportion to what a sequence of
    max_model_len holds in each (kv_groups.plan_blocks)."""
    if not sliding:
        return WindowLayout(num_blocks)
    full_group = shareable(sliding, spec)
    if full_group is not None:  # one pool: a block is one layer's K and V at each position of a group
        blocks = num_blocks * spec.num_layers // len(full_group.layers)
        log.info("KV cache groups: one pool of %d blocks for the full-attention group and %d sliding-window "
                 "groups of %d layers", blocks, len(sliding), len(full_group.layers))
        return WindowLayout(blocks, sliding, (0,) * len(sliding), full_group)
    n_sliding = {i for g in sliding for i in g.layers}
    full = KVGroup(None, tuple(i for i in range(spec.num_layers) if i not in n_sliding))
    layer_block = spec.bytes_per_block // spec.num_layers
    counts = plan_blocks(num_blocks * spec.bytes_per_block, (full, *sliding), layer_block, max_model_len,
                         spec.block_size, largest_chunk)
    log.info("KV cache groups: full attention %d blocks (%d layers); %s", counts[0], len(full.layers),
             "; ".join(f"window {g.window}: {n} blocks ({len(g.layers)} layers)" for g, n in zip(sliding, counts[1:])))
    return WindowLayout(counts[0], sliding, counts[1:])
