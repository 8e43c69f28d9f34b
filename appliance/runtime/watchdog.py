"""The progress watchdog (scheduler.watchdog_timeout, as SGLang's --watchdog-timeout).

The scheduler's loop beats once per turn: a turn is one step when there is work, a 50 ms poll when there is none,
so a loop that stops beating is stuck inside a step (a frozen worker, a collective that never returns) or in
something that must not block. A daemon thread checks the beat; after `timeout` seconds without one it calls
`on_stall` once. The scheduler's `on_stall` logs its own stacks and reports the stage failed with
`dump_stacks`: the supervisor then has every stage log its Python stacks (faulthandler on SIGUSR1, registered
by runtime/stage.py), tells the HTTP process (/health answers 503, open requests end with an error) and stops
the pipeline with exit code 1.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Watchdog:
    def __init__(self, timeout: float, on_stall: Callable[[float], None]) -> None:
        self.timeout = timeout
        self.on_stall = on_stall
        self._last = time.monotonic()
        self._thread = threading.Thread(target=self._watch, name="watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._last = time.monotonic()
        self._thread.start()
        return self

    def beat(self) -> None:
        self._last = time.monotonic()

    def _watch(self) -> None:
        period = min(1.0, self.timeout / 4)
        while True:
            time.sleep(period)
            stalled = time.monotonic() - self._last
            if stalled > self.timeout:
                self.on_stall(stalled)
                return
