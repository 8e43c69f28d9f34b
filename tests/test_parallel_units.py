"""Pieces of multi-process parallelism without processes: the topology (names, sockets, worker environments),
the data-parallel router's choice and merged stats, shard-only checkpoint reads, parallelism.devices and its
translation from CUDA_VISIBLE_DEVICES."""
from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from appliance.executor.distributed import DistributedEnv, LazyCheckpointTensor
from appliance.runtime.addresses import Addresses
from appliance.runtime.dp_router import DataParallelClient, combine_stats
from appliance.runtime.topology import Topology, replica_peers, window_groups_of


def _config(**par: Any) -> Any:
    from appliance.config import ApplianceConfig

    return ApplianceConfig.model_validate({"parallelism": par})


def test_replicas_own_their_sockets_and_workers() -> None:
    topo = Topology.from_config(_config(tp=2, dp=2))
    base = Addresses("c", "f", "req", "out", "res", ("p0", "p1", "p2", "p3"))
    r0, r1 = topo.replica_addresses(base, 0), topo.replica_addresses(base, 1)
    assert (r0.requests, r0.outputs, r0.results, r0.plans) == ("req", "out", "res", ("p0", "p1"))
    assert (r1.requests, r1.outputs, r1.results, r1.plans) == ("req.1", "out.1", "res.1", ("p2", "p3"))
    assert r1.control == "c"  # one supervisor for all
    assert [w.name for w in topo.workers(1)] == ["dp1.worker0", "dp1.worker1"]
    assert [w.index for w in topo.workers(1)] == [2, 3] and topo.scheduler_name(1) == "scheduler1"
    single = Topology.from_config(_config(tp=2))
    assert [w.name for w in single.workers(0)] == ["worker0", "worker1"] and single.scheduler_name(0) == "scheduler"
    with pytest.raises(ValueError):
        topo.replica_addresses(base, 2)


def test_worker_environment_and_devices() -> None:
    topo = Topology.from_config(_config(tp=2, dp=2, devices=[7, 5, 3, 1], dist_init_addr="10.0.0.1:4000"))
    slot = topo.workers(1)[1]
    env = topo.worker_env(slot, topo.master_port(1))
    assert env == {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4001",
                   "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "1"}
    assert DistributedEnv.from_env(env) == DistributedEnv(1, 2, 0, "10.0.0.1", 4001)
    plain = Topology.from_config(_config(tp=2))
    env = plain.worker_env(plain.workers(0)[1], 1234)
    assert "CUDA_VISIBLE_DEVICES" not in env and env["LOCAL_RANK"] == "1"
    with pytest.raises(ValueError, match="MASTER_PORT"):
        DistributedEnv.from_env({"RANK": "0", "WORLD_SIZE": "2"})


def test_devices_setting_is_checked() -> None:
    assert _config(tp=2, devices=[3, 2]).parallelism.devices == [3, 2]
    for bad in ([3], [1, 1], [-1, 0]):
        with pytest.raises(ValueError, match="devices"):
            _config(tp=2, devices=bad)


def test_translate_maps_cuda_visible_devices() -> None:
    from appliance.translate.translator import translate_text

    (tr,) = translate_text("CUDA_VISIBLE_DEVICES=4,5,6 vllm serve org/m --tensor-parallel-size 2").translations
    assert tr.get("parallelism.devices") == [4, 5] and tr.get("parallelism.tp") == 2  # the first tp x dp
    (tr,) = translate_text("CUDA_VISIBLE_DEVICES=GPU-abc,GPU-def vllm serve org/m --tp 2").translations
    assert tr.get("parallelism.devices") is None
    assert any("GPU-abc" in line for line in tr.context)


def test_replica_peers_takes_the_smallest_pool() -> None:
    merged = replica_peers([{"num_kv_blocks": 90, "max_model_len": 64, "num_host_blocks": 300, "num_disk_blocks": 9},
                            {"num_kv_blocks": 80, "max_model_len": 64, "num_host_blocks": 200, "num_disk_blocks": 7}])
    assert merged == {"num_kv_blocks": 80, "max_model_len": 64, "num_host_blocks": 200, "num_disk_blocks": 7}
    windows = replica_peers([{"num_kv_blocks": 9, "window_sizes": [4, 8], "window_blocks": [30, 7]},
                             {"num_kv_blocks": 8, "window_sizes": [4, 8], "window_blocks": [20, 9]}])
    assert windows["window_blocks"] == [20, 7] and window_groups_of(windows) == ((4, 8), (20, 7))


class _FakeReplica:
    def __init__(self, num_open: int) -> None:
        self.num_open, self.state, self.error_message, self.failed = num_open, "ready", "", ""

    def fail(self, message: str) -> None:
        self.state, self.failed, self.error_message = "failed", message, message

    async def generate(self, request_id: str, ids: list[int], sampling: Any):
        self.num_open += 1
        yield SimpleNamespace(request_id=request_id, finish_reason="stop")
        self.num_open -= 1

    def note_stop_string(self, request_id: str) -> None:
        self.noted = request_id


def test_router_prefers_the_least_loaded_replica_then_alternates() -> None:
    a, b = _FakeReplica(3), _FakeReplica(1)
    router = DataParallelClient([a, b])  # type: ignore[list-item]
    assert router.pick() == 1
    b.num_open = 3
    router._kv_usage = [0.5, 0.2]
    assert router.pick() == 1  # same load: the emptier KV pool

    async def run(rid: str) -> None:
        async for out in router.generate(rid, [1], None):  # type: ignore[arg-type]
            router.note_stop_string(out.request_id)  # reaches the replica that owns the request

    a.num_open = b.num_open = 0
    router._kv_usage = [0.0, 0.0]
    for i in range(4):
        asyncio.run(run(f"r{i}"))
    assert router.num_routed == [2, 2]  # sequential traffic alternates
    assert (a.noted, b.noted) == ("r2", "r3")
    b.fail("boom")
    assert router.state == "failed" and router.error_message == "boom"
    router.fail("all down")
    assert a.failed == "all down" and a.state == "failed"


def test_merged_stats_add_up() -> None:
    parts = [{"num_running": 1, "num_waiting": 0, "kv_blocks_total": 10, "kv_blocks_free": 8, "kv_blocks_cached": 1,
              "kv_blocks_owned": 1, "kv_cache_usage": 0.2, "accounting_ok": True, "idle": False, "num_steps": 5},
             {"num_running": 0, "num_waiting": 2, "kv_blocks_total": 10, "kv_blocks_free": 10, "kv_blocks_cached": 0,
              "kv_blocks_owned": 0, "kv_cache_usage": 0.0, "accounting_ok": False, "idle": True, "num_steps": 7}]
    s = combine_stats(parts)
    assert (s["num_running"], s["num_waiting"], s["kv_blocks_total"], s["kv_blocks_free"], s["num_steps"]) == \
        (1, 2, 20, 18, 12)
    assert s["kv_cache_usage"] == pytest.approx(0.1) and not s["accounting_ok"] and not s["idle"]
    assert s["replicas"] == parts


class _Recorder:
    """A safetensors slice stand-in that records which index each read asked for."""

    def __init__(self, full: torch.Tensor) -> None:
        self.full, self.reads = full, []

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        self.reads.append(index)
        return self.full[index].clone()


def _lazy(full: torch.Tensor) -> tuple[LazyCheckpointTensor, _Recorder]:
    rec = _Recorder(full)
    return LazyCheckpointTensor(rec, tuple(full.shape)), rec


def test_shard_loaders_read_only_their_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.layers import parallel_state
    from appliance.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(1, 2, None))
    full = torch.arange(48.0).reshape(8, 6)
    row = RowParallelLinear(6, 8)
    lazy, rec = _lazy(full)
    row.weight.weight_loader(row.weight, lazy)
    assert torch.equal(row.weight, full[:, 3:6]) and rec.reads == [(slice(0, 8), slice(3, 6))]
    merged = MergedColumnParallelLinear(6, [4, 4])
    lazy, rec = _lazy(full)
    merged.weight.weight_loader(merged.weight, lazy)  # an already-fused [gate; up]: two nested narrows each
    assert torch.equal(merged.weight, torch.cat([full[2:4], full[6:8]]))
    assert rec.reads == [(slice(2, 4), slice(0, 6)), (slice(6, 8), slice(0, 6))]


def test_lazy_tensor_behaves_like_the_tensor() -> None:
    full = torch.randn(5, 4)
    lazy, _ = _lazy(full)
    assert lazy.shape == full.shape and lazy.dim() == 2 and lazy.size(1) == 4
    assert torch.equal(lazy[1:3].materialize(), full[1:3]) and torch.equal(lazy[2], full[2])
    assert torch.equal(torch.cat([lazy, lazy]), torch.cat([full, full])) and lazy.dtype == full.dtype
    out = torch.empty(5, 4)
    out.copy_(lazy)
    assert torch.equal(out, full) and torch.equal(lazy.float(), full)
    with pytest.raises(IndexError):
        lazy.narrow(0, 3, 3)


def test_checkpoint_reads_are_lazy_only_with_shards(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.executor.model_loader import iterate_weights
    from appliance.layers import parallel_state

    assert all(isinstance(t, torch.Tensor) for _, t in iterate_weights(tiny_model, "auto"))
    monkeypatch.setattr(parallel_state, "_STATE", parallel_state.TensorParallelState(0, 2, None))
    for _, t in iterate_weights(tiny_model, "auto"):
        assert isinstance(t, LazyCheckpointTensor)


def test_two_node_topology_uses_the_heads_tcp_ports() -> None:
    from appliance.runtime.topology import scheduler_binds

    base = Addresses("c", "f", "req", "out", "res", ("p0", "p1", "p2", "p3"))
    head = Topology.from_config(_config(tp=4, nnodes=2, node_rank=0, dist_init_addr="10.1.1.1:5000"))
    other = Topology.from_config(_config(tp=4, nnodes=2, node_rank=1, dist_init_addr="10.1.1.1:5000"))
    assert [w.name for w in head.local_workers(0)] == ["worker0", "worker1"] and head.is_head
    assert [(w.name, w.local) for w in other.local_workers(0)] == [("worker2", 0), ("worker3", 1)]
    a = other.replica_addresses(base, 0)
    assert a == head.replica_addresses(base, 0)  # every node derives the same sockets
    assert a.plans == tuple(f"tcp://10.1.1.1:{5001 + g}" for g in range(4)) and a.results == "tcp://10.1.1.1:5005"
    assert scheduler_binds(a.plans[0]) and not scheduler_binds("ipc:///tmp/x/plan0")
    assert other.worker_env(other.local_workers(0)[1], other.master_port(0))["LOCAL_RANK"] == "1"


def test_multi_node_data_parallelism_is_refused() -> None:
    from appliance.config.support import check_supported

    cfg = _config(tp=2, dp=2, nnodes=2, dist_init_addr="10.1.1.1:5000")
    assert any("parallelism.nnodes" in m for m in check_supported(cfg))
    assert check_supported(_config(tp=2, nnodes=2, dist_init_addr="10.1.1.1:5000")) == []


def test_snapshots_feed_the_routers_kv_usage(tmp_path: Path) -> None:
    from appliance.observability.stats import StatsSnapshot
    from appliance.runtime.dp_router import make_engine_client

    seen = []
    obs = SimpleNamespace(on_snapshot=seen.append, metrics=None)
    addrs = Addresses(*(f"ipc://{tmp_path}/{n}" for n in ("c", "f", "rq", "o", "rs")), ("p0", "p1"))
    router = make_engine_client(addrs, _config(dp=2), None, obs)
    try:
        assert isinstance(router, DataParallelClient)
        assert router.replicas[1]._obs.metrics is None  # everything else reaches the shared observability
        snap = StatsSnapshot(0.0, dp_rank=1, kv_blocks_total=10, kv_blocks_owned=4)
        router.replicas[1]._obs.on_snapshot(snap)
        assert router._kv_usage == [0.0, 0.4] and seen == [snap]
        assert router.pick() == 0
    finally:
        asyncio.run(router.close())
