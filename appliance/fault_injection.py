"""Faults on purpose, for the tests of crash and hang handling: APPLIANCE_FAULT_INJECTION, read only when set.

A comma-separated list of entries (docs/reliability.md):
- `forward:raise:N` / `forward:hang:N`: every worker's forward raises, or sleeps for good, from its step N on
  (steps counted from 1 in each worker process);
- `sample:raise:SEED`: sampling a row of a request whose `seed` is SEED raises (a per-request fault).
Unset, nothing here runs beyond one environment lookup per process.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

ENV = "APPLIANCE_FAULT_INJECTION"


class InjectedFault(RuntimeError):
    """Raised by a fault APPLIANCE_FAULT_INJECTION asked for."""


@dataclass(frozen=True)
class Faults:
    forward_raise_at: int | None = None
    forward_hang_at: int | None = None
    sample_raise_seed: int | None = None

    def before_forward(self, step: int) -> None:
        if self.forward_raise_at is not None and step >= self.forward_raise_at:
            raise InjectedFault(f"injected fault: forward raises at step {step} ({ENV})")
        if self.forward_hang_at is not None and step >= self.forward_hang_at:
            while True:  # a frozen forward: only a signal ends it
                time.sleep(3600)

    def before_sample(self, seeds: list[int | None]) -> None:
        if self.sample_raise_seed is not None and self.sample_raise_seed in seeds:
            raise InjectedFault(f"injected fault: sampling a request with seed {self.sample_raise_seed} ({ENV})")


@functools.cache
def faults() -> Faults | None:
    """The faults this process was asked for, or None (the variable unset or empty)."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    kwargs: dict[str, int] = {}
    for entry in spec.split(","):
        bits = entry.strip().split(":")
        key = _KEYS.get((bits[0], bits[1])) if len(bits) == 3 else None
        if key is None or not bits[2].lstrip("-").isdigit():
            raise ValueError(f"{ENV}: cannot read {entry!r} (forward:raise:N, forward:hang:N, sample:raise:SEED)")
        kwargs[key] = int(bits[2])
    return Faults(**kwargs)


_KEYS = {("forward", "raise"): "forward_raise_at", ("forward", "hang"): "forward_hang_at",
         ("sample", "raise"): "sample_raise_seed"}
