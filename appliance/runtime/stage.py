"""Entry point of every pipeline child: `python -m appliance.runtime.stage` with a Bootstrap on stdin."""
from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from appliance.runtime.bootstrap import Bootstrap
from appliance.runtime.messages import CONTROL_CODEC, StageFailed
from appliance.runtime.process import die_with_parent, ignore_interrupts

if TYPE_CHECKING:
    from appliance.executor.runner_protocol import ModelRunnerProtocol


def report_failure(boot: Bootstrap, message: str, dump_stacks: bool = False) -> None:
    """Tell the supervisor why this stage is going down, so its exit message names the cause (from any thread:
    the socket is this call's own)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(boot.addresses.control)
    sock.send(CONTROL_CODEC.encode(StageFailed(boot.name, message, dump_stacks)))
    sock.close()


def main() -> int:
    return run_stage(Bootstrap.read(sys.stdin))


def run_stage(boot: Bootstrap, build_runner: Callable[[Bootstrap], ModelRunnerProtocol] | None = None) -> int:
    """Run the stage `boot` names until it stops; its exit code. build_runner: a worker's runner in place of
    the ModelRunner (benchmarks/host_path.py's timed stand-in)."""
    die_with_parent(boot.parent_pid)
    ignore_interrupts()
    # SIGUSR1 writes every thread's Python stack to stderr: the supervisor asks for it when a stage hangs
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    level = str(boot.config.get("observability", {}).get("log_level", "info")).upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {boot.name}[{os.getpid()}] %(levelname)s %(message)s")
    try:
        cache_dir = boot.config.get("cache", {}).get("compile_cache_dir")
        if cache_dir and boot.stage == "worker":  # before anything compiles
            from appliance.executor.compile_cache import use_compile_cache

            use_compile_cache(cache_dir)
        if boot.stage == "worker":
            from appliance.runtime.worker_proc import run_worker

            boot.wait_peers(sys.stdin)
            run_worker(boot) if build_runner is None else run_worker(boot, build_runner)
        elif boot.stage == "scheduler":
            from appliance.runtime.scheduler_proc import run_scheduler

            boot.wait_peers(sys.stdin)
            run_scheduler(boot)
        elif boot.stage == "tokenizer":
            from appliance.runtime.tokenizer_proc import (
                prepare_tokenizer,
                run_tokenizer,
            )

            run_tokenizer(boot, prepare_tokenizer(boot), sys.stdin)  # binds HTTP (503) before its turn
        else:
            raise ValueError(f"unknown stage {boot.stage!r}")
    except EOFError:
        return 1  # the supervisor went away while this stage waited for its turn
    except Exception as exc:  # noqa: BLE001 - any start-up failure is reported to the supervisor by name
        logging.getLogger("appliance.runtime").error("stage %s failed:\n%s", boot.name, traceback.format_exc())
        report_failure(boot, f"{type(exc).__name__}: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
