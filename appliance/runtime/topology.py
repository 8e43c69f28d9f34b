"""Who runs where: data-parallel replicas of tensor-parallel worker groups, their names, sockets and devices.

The pipeline is one tokenizer (HTTP) process in front of `dp` replicas; replica d is one scheduler and `tp`
workers. Each replica is its own torch.distributed world of size tp (replicas share no collectives, so one
replica's long prefill never stalls another's decodes). Worker g = d * tp + t runs on parallelism.devices[g]
when devices are listed (CUDA_VISIBLE_DEVICES of that one worker), else on local device g.
"""
from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import Any

from appliance.runtime.addresses import Addresses


@dataclass(frozen=True)
class WorkerSlot:
    replica: int
    tp_rank: int
    index: int  # d * tp + t: position among this node's workers (its local device without a devices list)
    name: str


@dataclass(frozen=True)
class Topology:
    tp: int = 1
    dp: int = 1
    devices: tuple[int, ...] | None = None
    dist_host: str = "127.0.0.1"
    dist_port: int | None = None  # from dist_init_addr; else a free port per replica, chosen at start-up

    @classmethod
    def from_config(cls, config: Any) -> Topology:
        par = config.parallelism
        devices = getattr(par, "devices", None)
        host, port = "127.0.0.1", None
        if par.dist_init_addr:
            host, _, p = str(par.dist_init_addr).rpartition(":")
            host, port = host.strip("[]") or "127.0.0.1", int(p)
        return cls(int(par.tp), int(par.dp), tuple(int(d) for d in devices) if devices else None, host, port)

    @property
    def num_workers(self) -> int:
        return self.tp * self.dp

    def worker_name(self, replica: int, tp_rank: int) -> str:
        return f"worker{tp_rank}" if self.dp == 1 else f"dp{replica}.worker{tp_rank}"

    def scheduler_name(self, replica: int) -> str:
        return "scheduler" if self.dp == 1 else f"scheduler{replica}"

    def workers(self, replica: int) -> list[WorkerSlot]:
        return [WorkerSlot(replica, t, replica * self.tp + t, self.worker_name(replica, t)) for t in range(self.tp)]

    def replica_addresses(self, addresses: Addresses, replica: int) -> Addresses:
        """The sockets of replica d: its own requests/outputs/results and its workers' plan sockets; replica 0
        keeps the pipeline's base names, so a dp=1 pipeline is exactly the single-replica one."""
        if not 0 <= replica < self.dp:
            raise ValueError(f"replica {replica} outside 0..{self.dp - 1}")
        sfx = f".{replica}" if replica else ""
        return dataclasses.replace(addresses, requests=addresses.requests + sfx, outputs=addresses.outputs + sfx,
                                   results=addresses.results + sfx,
                                   plans=tuple(addresses.plans[replica * self.tp : (replica + 1) * self.tp]))

    def master_port(self, replica: int) -> int:
        return self.dist_port + replica if self.dist_port is not None else free_port(self.dist_host)

    def worker_env(self, slot: WorkerSlot, master_port: int) -> dict[str, str]:
        """torch.distributed's environment for this worker, plus its one device when devices are listed."""
        env = {"RANK": str(slot.tp_rank), "WORLD_SIZE": str(self.tp), "MASTER_ADDR": self.dist_host,
               "MASTER_PORT": str(master_port), "LOCAL_RANK": str(slot.index)}
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(self.devices[slot.index])
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
    return merged
