"""Where a benchmark's host time goes, step by step: the engine phases of each step (with how the main thread
spent each submit and, on request, stack samples of it), the garbage collector's pauses, the device allocator's
cudaMalloc / cudaFree calls, the process's CPU throttling and the kernel's compaction stalls.
Shared by gpu_measure._tpot (the batch-1 figure) and bench_steps (whole runs)."""
from __future__ import annotations

import gc
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any


class GcPauses(list):
    """(generation, ms) of every collection from construction until stop(); with a census list, each full
    collection first appends the 10 most common types of the objects it will walk."""

    def __init__(self, census: list[dict[str, int]] | None = None) -> None:
        super().__init__()
        self.census = census
        self._began: list[float] = []
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            if self.census is not None and info["generation"] == 2:
                objects = gc.get_objects()
                top = Counter(type(o).__name__ for o in objects).most_common(10)
                self.census.append({"frozen": gc.get_freeze_count(), "objects": len(objects), **dict(top)})
            self._began.append(time.perf_counter())
        elif self._began:
            self.append((int(info["generation"]), (time.perf_counter() - self._began.pop()) * 1e3))

    def stop(self) -> dict[str, list[float]]:
        """Stops recording; per generation [count, total ms, longest ms]."""
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
        out: dict[str, list[float]] = {}
        for gen in sorted({g for g, _ in self}):
            ms = [t for g, t in self if g == gen]
            out[f"gen{gen}"] = [len(ms), round(sum(ms), 2), round(max(ms), 2)]
        return out


class StepPhases:
    """Per engine step, the ms spent in the scheduler's schedule and update and the executor's submit and collect
    (wrapped on the instances for the block): where a slow step's time went. `stacks`: a thread also samples the
    main thread's stack, for slow_submit_stacks."""

    NAMES = (("scheduler", "schedule"), ("executor", "submit"), ("executor", "collect"), ("scheduler", "update"))

    def __init__(self, eng: Any, stacks: bool = False) -> None:
        self.eng, self.stacks = eng, stacks
        self.steps: list[dict[str, float]] = []
        self.submits: list[tuple[float, float]] = []
        self.samples: list[tuple[float, tuple[str, ...]]] = []  # (time, innermost frames) of the main thread
        self._stop = False

    def __enter__(self) -> StepPhases:
        import threading

        for owner, name in self.NAMES:
            obj = getattr(self.eng, owner)
            setattr(obj, name, self._timed(name, getattr(obj, name)))
        self._main = threading.get_ident()
        self._thread = threading.Thread(target=self._sample, daemon=True) if self.stacks else None
        if self._thread is not None:  # it holds the interpreter lock now and then: slows the loop a little
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop = True
        if self._thread is not None:
            self._thread.join()
        for owner, name in self.NAMES:
            delattr(getattr(self.eng, owner), name)  # the class's method again

    def _sample(self) -> None:
        """Every ~0.5 ms, where the main thread is: which call a slow submit waits in."""
        import sys
        import traceback

        while not self._stop:
            frame = sys._current_frames().get(self._main)
            if frame is not None:
                stack = traceback.extract_stack(frame)[-6:]
                self.samples.append((time.perf_counter(), tuple(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                                                                  for f in stack)))
            time.sleep(0.0005)

    def _timed(self, name: str, fn: Any) -> Any:
        def call(*a: Any, **k: Any) -> Any:
            if name == "schedule":
                self.steps.append({})
            before = _thread_usage() if name == "submit" else None
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                end = time.perf_counter()
                self.steps[-1][name] = round((end - t) * 1e3, 3)
                if before is not None:
                    self.submits.append((t, end))
                    # how the main thread spent a submit: on a CPU (cpu_ms), blocked (waits: futex, ioctl),
                    # preempted (preempts: throttled or descheduled) or in page faults
                    after = _thread_usage()
                    self.steps[-1].update({f"submit_{k}": round(after[k] - before[k], 3) for k in after})
        return call

    def slow_submit_stacks(self, top: int = 4) -> list[tuple[int, tuple[str, ...]]]:
        """The main thread's most common stacks while a submit ran over twice the median submit."""
        med = statistics.median(b - a for a, b in self.submits)
        slow = [(a, b) for a, b in self.submits[2:] if b - a > 2 * med]  # not the prefill's
        seen = Counter(st for t, st in self.samples if any(a <= t <= b for a, b in slow))
        return [(n, st) for st, n in seen.most_common(top)]

    def at(self, step: int) -> dict[str, float]:
        return self.steps[step] if step < len(self.steps) else {}

    def median(self) -> dict[str, float]:
        return {name: round(statistics.median(s.get(name, 0.0) for s in self.steps), 3) for _, name in self.NAMES}


def _thread_usage() -> dict[str, float]:
    """The calling thread's CPU ms, voluntary / involuntary context switches and page faults so far."""
    import resource

    r = resource.getrusage(resource.RUSAGE_THREAD)
    return {"cpu_ms": (r.ru_utime + r.ru_stime) * 1e3, "waits": r.ru_nvcsw, "preempts": r.ru_nivcsw,
            "faults": r.ru_minflt + r.ru_majflt}


class HostCounters:
    """Process-wide host counters over a block: the cgroup's CPU throttling, the kernel's memory compaction
    stalls, and each thread's CPU ms. Any of them can stall a CUDA call that the main thread makes."""

    CGROUP = (Path("/sys/fs/cgroup/cpu.stat"), Path("/sys/fs/cgroup/cpu/cpu.stat"))
    VMSTAT = ("compact_stall", "thp_fault_alloc", "pgmajfault", "allocstall_normal")

    def __init__(self) -> None:
        self.start = self.snapshot()

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path in self.CGROUP:
            if path.exists():
                out.update({f"cg_{k}": int(v) for k, v in (ln.split() for ln in path.read_text().splitlines())
                            if "throttled" in k})
                break
        vm = Path("/proc/vmstat")
        if vm.exists():
            out.update({k: int(v) for k, v in (ln.split() for ln in vm.read_text().splitlines()) if k in self.VMSTAT})
        out["threads"] = _thread_cpu_ms()
        return out

    def stop(self) -> dict[str, Any]:
        """Deltas since construction; threads that used over 10 ms of CPU, by name."""
        end = self.snapshot()
        out: dict[str, Any] = {k: v - self.start.get(k, 0) for k, v in end.items() if k != "threads"}
        busy: Counter[str] = Counter()
        for tid, (name, ms) in end["threads"].items():
            busy[name] += ms - self.start["threads"].get(tid, (name, 0.0))[1]
        out["thread_cpu_ms"] = {n: round(ms, 1) for n, ms in busy.most_common() if ms > 10}
        out["thread_count"] = len(end["threads"])
        return out


def _thread_cpu_ms() -> dict[str, tuple[str, float]]:
    """tid -> (name, user + system CPU ms) for every thread of this process (Linux /proc)."""
    import os

    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[str, tuple[str, float]] = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            stat = (task / "stat").read_text()
        except OSError:
            continue  # the thread ended
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[task.name] = (name, (int(fields[11]) + int(fields[12])) * 1e3 / tick)
    return out


def device_allocs() -> dict[str, int]:
    """cudaMalloc / cudaFree calls and allocator retries so far (each can stall the stream)."""
    import torch

    if not torch.cuda.is_available():
        return {}
    st = torch.cuda.memory_stats()
    return {k: int(st.get(k, 0)) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")}
