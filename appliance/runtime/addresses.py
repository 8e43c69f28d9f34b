"""Socket addresses of one pipeline: `ipc://` paths in a private (0700) directory made at start-up.

ipc:// keeps every internal socket off the network entirely; the directory is removed when the supervisor exits.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Addresses:
    control: str
    frontend: str
    requests: str
    outputs: str
    results: str
    plans: tuple[str, ...]  # one per worker rank
    progress: str = ""  # start-up progress, supervisor -> tokenizer (runtime/startup_progress.py); "": none

    @classmethod
    def in_new_dir(cls, num_workers: int) -> tuple[Addresses, str]:
        # short base path: AF_UNIX paths are limited to ~107 bytes
        base = tempfile.mkdtemp(prefix="appl-", dir="/tmp" if os.path.isdir("/tmp") else None)
        os.chmod(base, 0o700)

        def ipc(name: str) -> str:
            return f"ipc://{base}/{name}"

        addrs = cls(
            control=ipc("control"),
            frontend=ipc("frontend"),
            requests=ipc("requests"),
            outputs=ipc("outputs"),
            results=ipc("results"),
            plans=tuple(ipc(f"plan{i}") for i in range(num_workers)),
            progress=ipc("progress"),
        )
        return addrs, base

    def to_dict(self) -> dict:
        d = asdict(self)
        d["plans"] = list(self.plans)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Addresses:
        return cls(**{**d, "plans": tuple(d["plans"])})


def remove_dir(base: str) -> None:
    shutil.rmtree(base, ignore_errors=True)
