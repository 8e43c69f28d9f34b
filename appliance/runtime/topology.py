"""Who runs where: data-parallel replicas of tensor-parallel worker groups, their names, sockets and devices.

The pipeline is one tokenizer (HTTP) process in front of `dp` replicas; replica d is one scheduler and `tp`
workers. Each replica is its own torch.distributed world of size tp (replicas share no collectives, so one
replica's long prefill never stalls another's decodes). Worker g = d * tp + t runs on parallelism.devices[g]
when devices are listed (CUDA_VISIBLE_DEVICES of that one worker), else on local device g (on several nodes:
g's position among its node's workers).

Several nodes (nnodes > 1, dp = 1): node n runs workers g with g // nprocs_per_node == n; node 0 (the head) also
runs the scheduler and the HTTP front. Every port derives from dist_init_addr's port P, the same on every node:
P + d is replica d's torch.distributed rendezvous, P + dp + g worker g's plan socket, P + dp + world + d replica
d's result socket, all bound on the head's address (the scheduler binds, workers connect: only the head's
address is known to everyone).
"""
from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from appliance.runtime.addresses import Addresses

if TYPE_CHECKING:
    from appliance.config.schema import ApplianceConfig


@dataclass(frozen=True)
class WorkerSlot:
    replica: int
    tp_rank: int
    index: int  # d * tp + t over all nodes
    name: str
    local: int = -1  # position among this node's workers: its device (devices[local], or local device `local`)


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    dp: int = 1
    devices: tuple[int, ...] | None = None
    dist_host: str = "127.0.0.1"
    dist_port: int | None = None  # from dist_init_addr; else a free port per replica, chosen at start-up
    nnodes: int = 1
    node_rank: int = 0

    @classmethod
    def from_config(cls, config: ApplianceConfig) -> Topology:
        par = config.parallelism
        devices = getattr(par, "devices", None)
        host, port = "127.0.0.1", None
        if par.dist_init_addr:
            host, _, p = str(par.dist_init_addr).rpartition(":")
            host, port = host.strip("[]") or "127.0.0.1", int(p)
        return cls(int(par.tp), int(par.dp), tuple(int(d) for d in devices) if devices else None, host, port,
                   int(par.nnodes), int(par.node_rank))

    @property
    def per_node(self) -> int:
        return self.num_workers // self.nnodes

    @property
    def is_head(self) -> bool:
        return self.node_rank == 0

    @property
    def multi_node(self) -> bool:
        return self.nnodes > 1

    @property
    def num_workers(self) -> int:
        return self.tp * self.dp

    def worker_name(self, replica: int, tp_rank: int) -> str:
        return f"worker{tp_rank}" if self.dp == 1 else f"dp{replica}.worker{tp_rank}"

    def scheduler_name(self, replica: int) -> str:
        return "scheduler" if self.dp == 1 else f"scheduler{replica}"

    def workers(self, replica: int) -> list[WorkerSlot]:
        """The replica's workers, over all nodes."""
        return [WorkerSlot(replica, t, g, self.worker_name(replica, t), g % self.per_node)
                for t, g in enumerate(range(replica * self.tp, (replica + 1) * self.tp))]

    def local_workers(self, replica: int) -> list[WorkerSlot]:
        """The replica's workers that this node runs."""
        return [w for w in self.workers(replica) if w.index // self.per_node == self.node_rank]

    def replica_addresses(self, addresses: Addresses, replica: int) -> Addresses:
        """The sockets of replica d: its own requests/outputs/results and its workers' plan sockets; replica 0
        keeps the pipeline's base names, so a dp=1 pipeline is exactly the single-replica one."""
        if not 0 <= replica < self.dp:
            raise ValueError(f"replica {replica} outside 0..{self.dp - 1}")
        sfx = f".{replica}" if replica else ""
        plans = tuple(addresses.plans[replica * self.tp : (replica + 1) * self.tp])
        results = addresses.results + sfx
        if self.multi_node:  # see the module doc: tcp on the head's address
            assert self.dist_port is not None, "multi-node needs dist_init_addr (config check)"
            base, world = self.dist_port + self.dp, self.num_workers
            plans = tuple(f"tcp://{self._host()}:{base + w.index}" for w in self.workers(replica))
            results = f"tcp://{self._host()}:{base + world + replica}"
        return dataclasses.replace(addresses, requests=addresses.requests + sfx, outputs=addresses.outputs + sfx,
                                   results=results, plans=plans)

    def _host(self) -> str:
        return f"[{self.dist_host}]" if ":" in self.dist_host else self.dist_host

    def master_port(self, replica: int) -> int:
        return self.dist_port + replica if self.dist_port is not None else free_port(self.dist_host)

    def worker_env(self, slot: WorkerSlot, master_port: int) -> dict[str, str]:
        """torch.distributed's environment for this worker, plus its one device when devices are listed."""
        env = {"RANK": str(slot.tp_rank), "WORLD_SIZE": str(self.tp), "MASTER_ADDR": self.dist_host,
               "MASTER_PORT": str(master_port), "LOCAL_RANK": str(slot.local)}
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.devices[slot.local])
            env["LOCAL_RANK"] = "0"  # the only device it sees
        return env


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the OS picks it); the rendezvous binds it moments later."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def replica_peers(infos: list[dict[str, Any]]) -> dict[str, Any]:
    """What a replica's scheduler needs of its workers: rank 0's info with the smallest KV pool of any rank
    (each rank sized its own pool; the scheduler may use only what every rank has)."""
    merged = dict(infos[0])
    merged["num_kv_blocks"] = min(int(i["num_kv_blocks"]) for i in infos)
    merged["num_host_blocks"] = min(int(i.get("num_host_blocks", 0)) for i in infos)
    merged["num_disk_blocks"] = min(int(i.get("num_disk_blocks", 0)) for i in infos)
    if merged.get("window_blocks"):  # the sliding-window groups' pools (executor/window_groups.py), each the same way
        merged["window_blocks"] = [min(n) for n in zip(*(i["window_blocks"] for i in infos), strict=True)]
    return merged


def window_groups_of(info: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The sliding-window KV cache groups' windows and pool sizes of a worker's ready info (none if absent)."""
    return (tuple(int(w) for w in info.get("window_sizes", [])),
            tuple(int(n) for n in info.get("window_blocks", [])))


def scheduler_binds(plan_address: str) -> bool:
    """Who binds a plan socket: the worker for a local ipc:// path, the scheduler for a tcp:// address (the
    head's, the one address every node knows)."""
    return plan_address.startswith("tcp://")
