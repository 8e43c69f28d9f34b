"""KV cache groups: the layers that share one block table because they attend alike (pure Python, no torch).

A model's attention layers fall into groups by the keys they read: the full-attention layers read the whole
context; the sliding-window layers of window W read only keys > p - W for a query at position p. Each group has
its own block pool and its own block table per request. On a sliding group the blocks wholly outside the window
of every future query go back to the pool (or are never taken, for a prefix hit or a long prefill) and their
table entries point at the pool's null block, which no kernel reads: a long context costs what its window costs.

Design as vLLM's hybrid KV cache manager (kv cache groups, its SlidingWindowManager), in this engine's terms:

- `kv_groups(windows)`: one group per distinct window, the full-attention group first; a model without sliding
  layers has exactly one group, and everything keeps today's single-table path.
- `first_live_block` / `release_outside_window`: which leading blocks of a sliding table no query from a given
  position on can read, and freeing them into NULL_BLOCK entries.
- `sliding_hit`: a prefix-cache hit must find the sliding group's last window of blocks present; otherwise the
  hit is shortened to the longest prefix whose window is.
- `plan_blocks`: the memory plan's split of a byte budget over the groups' pools, in proportion to what a
  sequence of max_model_len tokens holds in each (the whole budget, fractions of a sequence included).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from appliance.engine.block_pool import BlockPool

# the table entry of a released (or never taken) sliding-window block: the id a sliding group's pool reserves
NULL_BLOCK = 0


@dataclass(frozen=True)
class KVGroup:
    """Attention layers (indices among the model's attention layers) that share one block table."""

    window: int | None  # None: full attention; W: keys > p - W are visible to the query at position p
    layers: tuple[int, ...]

    @property
    def sliding(self) -> bool:
        return self.window is not None

    def blocks_held(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """The most blocks a sequence of up to `num_tokens` tokens holds at once in this group, computed in chunks
        of at most `chunk` tokens: the queries of a chunk read its keys and the W - 1 before them, which start
        anywhere in a block."""
        total = -(-num_tokens // block_size)
        if self.window is None:
            return total
        return min(total, -(-(self.window - 1 + chunk + block_size - 1) // block_size))


def kv_groups(windows: Sequence[int | None]) -> tuple[KVGroup, ...]:
    """Group attention layers by their window (one entry per layer, None = full): the full-attention group
    first (when there is one), then one group per window, narrowest first."""
    if not windows:
        raise ValueError("a model without attention layers has no KV cache groups")
    for w in windows:
        if w is not None and w < 1:
            raise ValueError(f"a sliding window must be at least 1 token, got {w}")
    keys = sorted(set(windows), key=lambda w: (w is not None, w or 0))
    return tuple(KVGroup(w, tuple(i for i, x in enumerate(windows) if x == w)) for w in keys)


def first_live_block(start: int, window: int, block_size: int) -> int:
    """The first block a query at position >= start may read: the oldest key such a query sees is start - W + 1,
    so every block before that key's block is outside the window of all of them."""
    return max(0, start - window + 1) // block_size


def max_blocks_held(window: int, block_size: int) -> int:
    """The most blocks a decoding sequence holds in a group of this window: the W keys of a query, starting
    anywhere in a block, span at most ceil((W + block - 1) / block) blocks (ceil(W / block) + 1 when the block
    divides W)."""
    return -(-(window + block_size - 1) // block_size)


def release_outside_window(table: list[int], released: int, start: int, window: int, block_size: int,
                           pool: BlockPool) -> int:
    """Free the blocks of a sliding group's table that no query from position `start` on reads, leaving
    NULL_BLOCK entries. `released`: how many leading entries are released already (the caller keeps it, so a
    step looks only at the blocks that left the window since the last). Returns the new count."""
    stop = min(first_live_block(start, window, block_size), len(table))
    if stop <= released:
        return released
    gone = [b for b in table[released:stop] if b != NULL_BLOCK]
    table[released:stop] = [NULL_BLOCK] * (stop - released)
    pool.free(gone)
    return stop


def sliding_hit(num_blocks: int, is_cached: Callable[[int], bool], window: int, block_size: int) -> int:
    """The longest prefix-cache hit of at most `num_blocks` blocks (a hit of the full-attention groups) whose
    window is cached in a sliding group: the queries after a hit of n blocks read blocks first_live_block(n *
    block) .. n - 1, each of which `is_cached(i)` must confirm. 0 when none is (the prefix is recomputed)."""
    last_miss = -1  # the last uncached block index before n, scanning n upwards
    best = 0
    for n in range(1, num_blocks + 1):
        if not is_cached(n - 1):
            last_miss = n - 1
        if last_miss < first_live_block(n * block_size, window, block_size):
            best = n
    return best


def plan_blocks(budget_bytes: int, groups: Sequence[KVGroup], layer_block_bytes: int, max_model_len: int,
                block_size: int, chunk: int = 1) -> tuple[int, ...]:
    """Blocks of each group's pool for a byte budget, in proportion to what a sequence of max_model_len tokens
    holds in each group (a sliding group's window and largest `chunk`), plus the null block of each sliding pool
    (paid from the budget too). The whole budget is split, not only the whole sequences it holds: a remainder
    of a fraction of a sequence (up to a ninth of the budget where nine sequences fit) would be memory no pool
    uses. `layer_block_bytes`: one layer's K and V for one block."""
    held = [g.blocks_held(max_model_len, block_size, chunk) for g in groups]
    per_seq = sum(h * len(g.layers) for h, g in zip(held, groups)) * layer_block_bytes
    nulls = sum(len(g.layers) for g in groups if g.sliding) * layer_block_bytes
    if per_seq == 0 or budget_bytes - nulls < per_seq:
        raise ValueError(f"the KV budget of {budget_bytes} bytes holds no sequence of {max_model_len} tokens "
                         f"({per_seq} bytes each)")
    # floor((budget - nulls) / per_seq * h) for each group: sum(count * layers * bytes) stays within the budget
    return tuple((budget_bytes - nulls) * h // per_seq + (1 if g.sliding else 0) for h, g in zip(held, groups))
