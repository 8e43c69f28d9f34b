"""The tokenizer process' EngineClient with data parallelism: one ZmqEngineClient per replica behind one front.

Routing: each new request goes to the replica with the fewest requests open from this front (ties: the lower
KV usage, from the replicas' ~1/s StatsSnapshots with metrics on or else the last stats query, then the fewer
requests sent so far, so sequential traffic alternates), and stays there (sticky): its outputs, its abort and
its KV blocks all live in that one replica. The supervisor's PipelineState reaches replica 0's client only (a PUSH socket has one
reader); the router mirrors a failure of any replica onto all of them, so every open request ends with an error.
"""
from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from appliance.engine.sampling_params import SamplingParams
from appliance.runtime.addresses import Addresses
from appliance.runtime.frontend import ZmqEngineClient
from appliance.runtime.pipeline_client import PipelineClient
from appliance.server.engine_client import EngineDead, QueueFull, RequestOutput

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig

# stats keys that add up over replicas; the rest are combined below
_SUMMED = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "kv_blocks_cached",
           "kv_blocks_owned", "num_preemptions", "num_steps", "malformed_frames", "spec_num_drafts",
           "spec_num_draft_tokens", "spec_num_accepted_tokens", "tier_host_stored", "tier_host_loaded",
           "tier_swapped_out", "tier_swapped_in", "tier_disk_spilled", "tier_disk_fetched")


def make_engine_client(addresses: Addresses, config: ApplianceConfig, max_queued_requests: int | None,
                       obs: Any = None) -> PipelineClient:
    """A plain ZmqEngineClient for one replica, a DataParallelClient for several."""
    dp = int(config.parallelism.dp)
    if dp == 1:
        return ZmqEngineClient(addresses, max_queued_requests, obs)
    from appliance.runtime.topology import Topology

    topo = Topology.from_config(config)
    kv_usage = [0.0] * dp
    clients = []
    for d in range(dp):
        addrs = topo.replica_addresses(addresses, d)
        if d:  # only replica 0's client reads the supervisor's PipelineState (see module doc)
            addrs = dataclasses.replace(addrs, frontend=f"{addresses.frontend}.unused{d}")
        clients.append(ZmqEngineClient(addrs, max_queued_requests, None if obs is None else _SnapshotTap(obs, kv_usage)))
    return DataParallelClient(clients, kv_usage)


class _SnapshotTap:
    """The shared frontend observability, plus a note of each replica's KV usage from its ~1/s StatsSnapshot
    (sent when metrics are enabled), for routing."""

    def __init__(self, obs: Any, kv_usage: list[float]) -> None:
        self._obs, self._kv_usage = obs, kv_usage

    def on_snapshot(self, snap: Any) -> None:
        if 0 <= snap.dp_rank < len(self._kv_usage) and snap.kv_blocks_total:
            self._kv_usage[snap.dp_rank] = snap.kv_blocks_owned / snap.kv_blocks_total
        self._obs.on_snapshot(snap)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._obs, name)


class DataParallelClient(PipelineClient):
    def __init__(self, replicas: list[PipelineClient], kv_usage: list[float] | None = None) -> None:
        if not replicas:
            raise ValueError("no replicas")
        self.replicas = replicas
        self._owner: dict[str, int] = {}  # request id -> replica, while it is open
        # each replica's KV usage from its last snapshot or stats() reply (shared with the snapshot taps)
        self._kv_usage = kv_usage if kv_usage is not None else [0.0] * len(replicas)
        self.num_routed = [0] * len(replicas)
        self._watch: asyncio.Task | None = None

    # -- EngineClient --------------------------------------------------------------------------------------

    @property
    def state(self) -> str:
        states = [r.state for r in self.replicas]
        for s in ("failed", "draining"):
            if s in states:
                return s
        return states[0]

    @property
    def error_message(self) -> str:
        return next((r.error_message for r in self.replicas if r.state == "failed"), "")

    @property
    def num_open(self) -> int:
        return sum(r.num_open for r in self.replicas)

    def check_capacity(self, num_requests: int) -> None:
        state = self.state
        if state == "failed":
            raise EngineDead(self.error_message or "the engine failed")
        if state == "draining":
            raise EngineDead("the server is shutting down")
        errors: list[QueueFull] = []
        for r in self.replicas:
            try:
                r.check_capacity(num_requests)
                return
            except QueueFull as exc:
                errors.append(exc)
        raise errors[0]

    def release_reserved(self, count: int) -> None:
        """The router holds no room itself: the replica whose check passed holds it (Admission.owner)."""

    def pick(self) -> int:
        """The replica a new request goes to: fewest open requests, then lowest KV usage, then fewest routed."""
        return min(range(len(self.replicas)),
                   key=lambda d: (self.replicas[d].num_open, self._kv_usage[d], self.num_routed[d], d))

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       sampling: SamplingParams) -> AsyncIterator[RequestOutput]:
        if request_id in self._owner:
            raise ValueError(f"duplicate request id {request_id!r}")
        d = self.pick()
        self._owner[request_id] = d
        self.num_routed[d] += 1
        try:
            async for out in self.replicas[d].generate(request_id, prompt_token_ids, sampling):
                yield out
        finally:
            self._owner.pop(request_id, None)

    def note_stop_string(self, request_id: str) -> None:
        d = self._owner.get(request_id)
        if d is not None:
            self.replicas[d].note_stop_string(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            owner = self._owner.get(rid)
            for d in ([owner] if owner is not None else range(len(self.replicas))):
                by_replica.setdefault(d, []).append(rid)
        for d, rids in by_replica.items():
            await self.replicas[d].abort(rids)

    async def stats(self) -> dict[str, Any]:
        parts = await asyncio.gather(*(r.stats() for r in self.replicas))
        for d, p in enumerate(parts):
            self._kv_usage[d] = float(p.get("kv_cache_usage", 0.0))
        return combine_stats(list(parts))

    # -- lifecycle -----------------------------------------------------------------------------------------

    def start(self) -> None:
        for r in self.replicas:
            r.start()
        self._watch = asyncio.create_task(self._mirror_failure())

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        for r in self.replicas:
            await r.close()

    def fail(self, message: str) -> None:
        for r in self.replicas:
            r.fail(message)

    async def _mirror_failure(self) -> None:
        while True:
            await asyncio.sleep(0.05)
            failed = [r for r in self.replicas if r.state == "failed"]
            if failed and len(failed) < len(self.replicas):
                self.fail(failed[0].error_message)


def combine_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """One pipeline-wide stats dict (the single-replica keys) plus each replica's own under "replicas"."""
    out: dict[str, Any] = {k: sum(int(p.get(k, 0)) for p in parts) for k in _SUMMED}
    out["kv_cache_usage"] = sum(float(p.get("kv_cache_usage", 0.0)) for p in parts) / len(parts)
    out["prefix_hit_rate"] = sum(float(p.get("prefix_hit_rate", 0.0)) for p in parts) / len(parts)
    out["accounting_ok"] = all(bool(p.get("accounting_ok", True)) for p in parts)
    out["idle"] = all(bool(p.get("idle", True)) for p in parts)
    out["replicas"] = parts
    return out
