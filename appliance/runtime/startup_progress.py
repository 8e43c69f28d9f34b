"""Start-up progress across the pipeline: the supervisor's board of each stage's latest phase (console lines, the
frame it publishes) and the HTTP process' reader of that frame (/health's 503 body until the pipeline is ready).

Workers send StageProgress on the control socket as they enter a phase or finish an item (executor/startup.py).
The supervisor logs a stage's line when its phase changes and at most every `log_interval_s` within a phase
("worker0: capturing decode graphs 37/140 (52.3 s)"), and publishes the whole board on the progress socket
(PUB/SUB: a frame sent before the HTTP process subscribed is dropped, so the board is published again each
second while stages start).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from appliance.runtime.messages import PROGRESS_CODEC, StageProgress, StartupProgress

log = logging.getLogger("appliance.runtime")

REPUBLISH_S = 1.0


class ProgressBoard:
    """The supervisor's view: the latest StageProgress of each stage, logged and published."""

    def __init__(self, sock: zmq.Socket | None, log_interval_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.sock, self.log_interval_s, self.clock = sock, log_interval_s, clock
        self.started = clock()
        self.latest: dict[str, StageProgress] = {}
        self._logged: dict[str, tuple[str, float]] = {}  # stage -> (phase, when) of its last console line
        self._published = float("-inf")

    def update(self, msg: StageProgress) -> None:
        self.latest[msg.stage] = msg
        now = self.clock()
        phase, when = self._logged.get(msg.stage, ("", float("-inf")))
        if msg.phase != phase or now - when >= self.log_interval_s or (msg.total and msg.done == msg.total):
            log.info("%s", msg.describe())
            self._logged[msg.stage] = (msg.phase, now)
        self.publish()

    def ready(self, stage: str, pid: int) -> None:
        """A stage reported ready (elapsed: since the supervisor started)."""
        if stage in self.latest:
            self.latest[stage] = StageProgress(stage, pid, "ready", 0, 0, self.clock() - self.started)
            self.publish()

    def frame(self) -> StartupProgress:
        return StartupProgress(list(self.latest.values()), round(self.clock() - self.started, 2))

    def publish(self) -> None:
        if self.sock is None:
            return
        try:
            self.sock.send(PROGRESS_CODEC.encode(self.frame()), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # no subscriber can be slow on PUB; a frame lost here is replaced by the next
        self._published = self.clock()

    def tick(self) -> None:
        """Called while waiting for stages: publish again once a second (for a subscriber that joined late)."""
        if self.clock() - self._published >= REPUBLISH_S:
            self.publish()


class ProgressWatch:
    """The HTTP process' subscription, read by a task until the pipeline is ready; `latest` is the last frame."""

    def __init__(self, address: str) -> None:
        self._ctx = zmq.asyncio.Context.instance()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(address)
        self.latest: StartupProgress | None = None
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while True:
            msg = PROGRESS_CODEC.decode_or_none(await self._sock.recv())
            if isinstance(msg, StartupProgress):
                self.latest = msg

    def close(self) -> None:
        self._task.cancel()
        self._sock.close(0)


def progress_body(frame: StartupProgress | None) -> dict[str, object]:
    """/health's 503 body while the pipeline starts: each stage's phase, how far along, seconds since spawn."""
    stages = {p.stage: {"phase": p.phase, "done": p.done, "total": p.total, "elapsed_s": round(p.elapsed_s, 2)}
              for p in (frame.stages if frame is not None else [])}
    message = "; ".join(p.describe() for p in frame.stages) if frame is not None and frame.stages else ""
    return {"status": "starting", "message": message or "the server is starting", "stages": stages,
            "elapsed_s": frame.elapsed_s if frame is not None else None}
