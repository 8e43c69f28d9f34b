"""What a child stage is told at start-up, sent as JSON lines on its stdin (never pickled, never on the command
line where `ps` would show an api_key).

Line 1 (at spawn): who it is, the config, the socket addresses. Line 2 (once the stages before it are ready):
their StageReady infos. A child does its slow preparation (imports, tokenizer loading) between the two, so
all stages warm up in parallel while still becoming ready in pipeline order.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import IO, Any

from appliance.runtime.addresses import Addresses


@dataclass(frozen=True)
class Bootstrap:
    stage: str  # "worker", "scheduler" or "tokenizer"
    name: str  # unique stage name: "worker0", "scheduler", "tokenizer"
    rank: int
    world_size: int
    parent_pid: int
    addresses: Addresses
    config: dict[str, Any]  # ApplianceConfig.to_dict()
    peers: dict[str, dict[str, Any]] = field(default_factory=dict)  # StageReady.info of the stages started before
    spawned_at: float = 0.0  # the supervisor's time.time() at the spawn: start-up phases count from it

    def dumps(self) -> str:
        return json.dumps({
            "stage": self.stage, "name": self.name, "rank": self.rank, "world_size": self.world_size,
            "parent_pid": self.parent_pid, "addresses": self.addresses.to_dict(), "config": self.config,
            "spawned_at": self.spawned_at,
        }) + "\n"

    @classmethod
    def read(cls, stream: IO[str]) -> Bootstrap:
        line = stream.readline()
        if not line:
            raise EOFError("no bootstrap on stdin (the supervisor is gone)")
        d = json.loads(line)
        d["addresses"] = Addresses.from_dict(d["addresses"])
        return cls(**d)

    def wait_peers(self, stream: IO[str]) -> None:
        """Block until the supervisor sends the infos of the stages started before this one."""
        line = stream.readline()
        if not line:
            raise EOFError("the supervisor closed the bootstrap before this stage's turn")
        self.peers.update(json.loads(line))

    def load_config(self) -> Any:
        from appliance.config import ApplianceConfig
        from appliance.config.schema import SKIP_CROSS_CHECKS

        # validated (cross checks included) by the supervisor already; a full dump would trip "given" checks
        return ApplianceConfig.model_validate(self.config, context={SKIP_CROSS_CHECKS: True})
