"""Start-up progress of a worker: the phase it is in (loading weights, compiling, capturing), how far along, and
the seconds each phase took.

A cold start of an 8B model spends a minute in imports, weight loading, memory profiling and the warm-up
(executor/warmup.py), all before the first request. `STARTUP` records each phase as the worker enters it: the
worker process forwards every change to the supervisor (console lines) and the HTTP process (/health's 503 body)
through `STARTUP.sink`, and logs `STARTUP.breakdown()` once ready, so a log shows where a cold start went.
Elapsed seconds count from the process' spawn (`start_at`), so the interpreter's start and the imports show too.

APPLIANCE_TEST_HOLD_STARTUP (tests only): the path of a file; while it exists the worker waits in a phase of
that name before it reports ready, so a test can see the start-up state for as long as it needs.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

HOLD_ENV = "APPLIANCE_TEST_HOLD_STARTUP"
PROCESS_START = "process start"


@dataclass(frozen=True)
class Progress:
    phase: str  # "loading weights", "capturing decode graphs"
    done: int = 0  # items finished of total (0 and 0 for a phase without items)
    total: int = 0
    elapsed_s: float = 0.0  # since the process was spawned


Sink = Callable[[Progress], None]


class StartupLog:
    """Phases entered in order; each ends when the next begins (or at `finish`). Not thread-safe: the worker's
    start-up runs on one thread."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.origin = clock()
        self.sink: Sink | None = None
        self.took: dict[str, float] = {}  # phase -> seconds, in the order first entered
        self.current: Progress | None = None
        self._entered = self.origin

    def start_at(self, wall_time: float) -> None:
        """Count elapsed seconds from this wall-clock time (the supervisor's spawn of the process)."""
        self.origin = self.clock() - max(0.0, time.time() - wall_time)
        if self.current is None:
            self._entered = self.origin

    def elapsed(self) -> float:
        return self.clock() - self.origin

    def enter(self, phase: str, total: int = 0) -> None:
        """Begin a phase (ending the one before). The time before the first phase is the `process start`
        (the interpreter and the stage's own imports)."""
        self._close()
        if not self.took:
            self.took[PROCESS_START] = self.clock() - self.origin
        self.current = Progress(phase, 0, total, self.elapsed())
        self._entered = self.clock()
        self._emit()

    def advance(self, done: int | None = None) -> None:
        """One more item of the current phase finished (or `done` of them)."""
        cur = self.current
        if cur is None:
            return
        n = cur.done + 1 if done is None else done
        self.current = Progress(cur.phase, n, max(cur.total, n), self.elapsed())
        self._emit()

    @contextlib.contextmanager
    def phase(self, name: str, total: int = 0) -> Iterator[None]:
        self.enter(name, total)
        try:
            yield
        finally:
            self._close()

    def finish(self) -> float:
        """End the current phase; returns the seconds since the process was spawned."""
        self._close()
        return self.elapsed()

    def breakdown(self) -> str:
        """"start-up 71.2 s: process start 1.1 s, imports 16.0 s, ..." (phases in order; `other` is the time
        between phases)."""
        total = self.elapsed()
        other = total - sum(self.took.values())
        parts = [f"{name} {s:.1f} s" for name, s in self.took.items()]
        if other >= 0.05:
            parts.append(f"other {other:.1f} s")
        return f"start-up {total:.1f} s: " + ", ".join(parts)

    def _close(self) -> None:
        if self.current is None:
            return
        name = self.current.phase
        self.took[name] = self.took.get(name, 0.0) + (self.clock() - self._entered)
        self.current = None

    def _emit(self) -> None:
        if self.sink is not None and self.current is not None:
            self.sink(self.current)


STARTUP = StartupLog()  # the process' one start-up (a worker process builds one ModelRunner)


def hold_for_test(log: StartupLog = STARTUP, poll_s: float = 0.05) -> None:
    """Wait in a phase while the file APPLIANCE_TEST_HOLD_STARTUP names exists (tests only; unset: no-op)."""
    path = os.environ.get(HOLD_ENV)
    if not path or not os.path.exists(path):
        return
    with log.phase(f"held by {HOLD_ENV}"):
        while os.path.exists(path):
            time.sleep(poll_s)
