"""What every pipeline child does at start-up: die with its parent, leave Ctrl-C to the supervisor.

Children run `python -m appliance.runtime.stage` in their own process group (so a terminal's SIGINT reaches only
the supervisor, which then stops them in order). If the supervisor dies, even by SIGKILL, the kernel sends each
child SIGKILL (Linux PR_SET_PDEATHSIG); elsewhere, and as a backstop, the loops poll `parent_alive`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except OSError:
            pass  # polling below still catches it
    if not parent_alive(parent_pid):  # the parent died before prctl took effect
        os._exit(1)


def parent_alive(parent_pid: int) -> bool:
    return os.getppid() == parent_pid


def ignore_interrupts() -> None:
    """Ctrl-C is the supervisor's to handle; children are stopped with SIGTERM in pipeline order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
