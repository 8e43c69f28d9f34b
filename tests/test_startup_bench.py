"""benchmarks/cold_start.py reads the worker's own start-up lines out of a server log: the breakdown that
executor/startup.py writes and the warm-up's summary, so the cold / warm comparison prints what the worker measured."""
from __future__ import annotations

from appliance.executor.startup import StartupLog
from benchmarks.cold_start import phases, worker_lines


class Clock:
    def __init__(self) -> None:
        self.now = 10.0

    def __call__(self) -> float:
        return self.now


def test_the_breakdown_and_warm_up_lines_are_read_back() -> None:
    clock = Clock()
    log = StartupLog(clock)
    clock.now += 1.5
    for name, s in (("imports", 6.0), ("loading weights", 2.25), ("capturing decode graphs", 9.0)):
        with log.phase(name):
            clock.now += s
    log.finish()
    text = "\n".join([
        "2026-11-27 10:00:00 worker0[12] INFO compile cache: TRITON_CACHE_DIR=/c/triton",
        ("2026-11-27 10:00:09 worker0[12] INFO warm-up: 56 decode graphs (batch sizes 1..256 (35), up to 2048 tokens "
         "of context) and 0 piecewise token buckets captured, kernels compiled, in 9.0 s (decode graphs 9.0 s)"),
        f"2026-11-27 10:00:10 worker0[12] INFO worker 0 {log.breakdown()}",
        ("2026-11-27 10:00:10 worker0[12] INFO compile ahead: 80 of 120 listed Triton variants compiled by 8 "
         "processes, 3 stopped unfinished"),
        "2026-11-27 10:00:10 worker1[13] INFO worker 1 start-up 99.0 s: imports 99.0 s"])
    lines = worker_lines(text)
    assert lines["breakdown"] == log.breakdown() and lines["warm_up"].startswith("warm-up: 56 decode graphs")
    assert phases(lines["breakdown"]) == {"process start": 1.5, "imports": 6.0, "loading weights": 2.2,
                                          "capturing decode graphs": 9.0}
    assert lines["compile_ahead"].startswith("compile ahead: 80 of 120")
    assert worker_lines("no worker here") == {"breakdown": "", "warm_up": "", "compile_ahead": ""}
    assert phases("") == {}
