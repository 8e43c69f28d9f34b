"""Entry point of every pipeline child: `python -m appliance.runtime.stage` with a Bootstrap on stdin."""
from __future__ import annotations

import logging
import os
import sys
import traceback

import zmq

from appliance.runtime.bootstrap import Bootstrap
from appliance.runtime.messages import CONTROL_CODEC, StageFailed
from appliance.runtime.process import die_with_parent, ignore_interrupts


def report_failure(boot: Bootstrap, message: str) -> None:
    """Tell the supervisor why this stage is going down, so its exit message names the cause."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(boot.addresses.control)
    sock.send(CONTROL_CODEC.encode(StageFailed(boot.name, message)))
    sock.close()


def main() -> int:
    boot = Bootstrap.read(sys.stdin)
    die_with_parent(boot.parent_pid)
    ignore_interrupts()
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
            run_worker(boot)
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
