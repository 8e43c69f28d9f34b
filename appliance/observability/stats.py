"""The scheduler's state, as the tokenizer process sees it: one typed snapshot of plain numbers.

The scheduler process owns the engine (running / waiting queues, the block pool, the prefix cache), the
tokenizer process owns the HTTP server and /metrics. The scheduler builds a `StatsSnapshot` (periodically and
when asked) and sends it across the pipeline; the tokenizer process sets gauges from the latest one and turns
the cumulative counters into Prometheus counter increments (see metrics.py). Counters are cumulative over the
engine's life rather than deltas, so a lost or duplicated snapshot never double counts.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = ["StatsSnapshot", "snapshot_from_core"]


@dataclass(frozen=True)
class StatsSnapshot:
    """Scheduler state at `timestamp` (time.time() of the scheduler process). msgpack friendly."""

    timestamp: float
    dp_rank: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0  # on the free list
    kv_blocks_cached: int = 0  # unreferenced, kept for prefix hits (evictable)
    kv_blocks_owned: int = 0  # referenced by live requests, counted independently of the other two
    # cumulative over the engine's life:
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_preemptions: int = 0
    num_steps: int = 0
    spec_num_drafts: int = 0  # speculative steps that proposed drafts
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = dataclasses.field(default_factory=list)  # [j]: verifications accepting draft j
    # hybrid models' state cache (0 without one): request slots, the ones held by running requests, its bytes
    state_slots_total: int = 0
    state_slots_used: int = 0
    state_cache_bytes: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "timestamp":
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise TypeError(f"StatsSnapshot.timestamp must be a number, got {v!r}")
            elif f.name == "spec_accepted_per_pos":
                if not isinstance(v, list) or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in v):
                    raise ValueError(f"StatsSnapshot.spec_accepted_per_pos must be a list of non-negative ints, "
                                     f"got {v!r}")
            elif not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"StatsSnapshot.{f.name} must be a non-negative int, got {v!r}")
        if self.prefix_cache_hits > self.prefix_cache_queries:
            raise ValueError("StatsSnapshot: prefix_cache_hits > prefix_cache_queries")
        if self.spec_num_accepted_tokens > self.spec_num_draft_tokens:
            raise ValueError("StatsSnapshot: spec_num_accepted_tokens > spec_num_draft_tokens")

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of blocks held by live requests (evictable cache blocks count as available), 0-1."""
        return self.kv_blocks_owned / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def kv_accounting_drift(self) -> int:
        """total - (free + cached + owned): 0 when every block is in exactly one place."""
        return self.kv_blocks_total - (self.kv_blocks_free + self.kv_blocks_cached + self.kv_blocks_owned)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StatsSnapshot:
        """Strict: unknown keys are an error (a newer sender, or garbage), missing keys take defaults."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"StatsSnapshot: unknown fields {sorted(unknown)}")
        if "timestamp" not in d:
            raise ValueError("StatsSnapshot: timestamp is required")
        return cls(**dict(d))


def snapshot_from_core(core: Any, dp_rank: int = 0, timestamp: float | None = None,
                       spec: tuple[int, int, int] = (0, 0, 0), verify_accounting: bool = True) -> StatsSnapshot:
    """Build a snapshot from an `engine.EngineCore` (duck typed: only its scheduler / pool / cache are read).

    With `verify_accounting`, `owned` is counted from the refcounts (BlockPool.check_accounting), not derived as
    total - free - cached, so the drift gauge can show a pool whose lists and refcounts disagree. That walk is
    O(num_blocks) (about 12 ms per 100k blocks): build such snapshots on a timer (about once a second), not
    every step. Without it the counts are the pool's O(1) counters and the drift is 0 by construction.
    `spec` is (drafts, draft tokens, accepted tokens), cumulative, when the engine runs speculative decoding.
    """

    sched = core.scheduler
    pool = sched.pool
    cache = sched.cache
    if verify_accounting:
        report = pool.check_accounting()
        total, free, cached, owned = report.total, report.free, report.cached, report.owned
    else:
        total, free, cached, owned = pool.num_blocks, pool.num_free, pool.num_evictable, pool.num_owned
    drafts, draft_tokens, accepted = spec
    return StatsSnapshot(
        timestamp=time.time() if timestamp is None else timestamp,
        dp_rank=dp_rank,
        num_running=len(sched.running),
        num_waiting=len(sched.waiting),
        kv_blocks_total=total,
        kv_blocks_free=free,
        kv_blocks_cached=cached,
        kv_blocks_owned=owned,
        prefix_cache_queries=int(cache.queried_tokens),
        prefix_cache_hits=int(cache.hit_tokens),
        num_preemptions=int(sched.num_preemptions),
        num_steps=int(core.stats().num_steps),
        spec_num_drafts=drafts,
        spec_num_draft_tokens=draft_tokens,
        spec_num_accepted_tokens=accepted,
        spec_accepted_per_pos=list(getattr(getattr(sched, "spec", None), "accepted_per_pos", ())) if drafts else [],
        state_slots_total=int(core.config.num_state_slots),
        state_slots_used=len(sched.running) if core.config.num_state_slots else 0,
        state_cache_bytes=int(core.config.state_cache_bytes),
    )
