"""What every pipeline child does at start-up: die with its parent, leave Ctrl-C to the supervisor.

Children run `python -m appliance.runtime.stage` in their own process group (so a terminal's SIGINT reaches only
the supervisor, which then stops them in order). If the supervisor dies, even by SIGKILL, the kernel sends each
child SIGKILL (Linux PR_SET_PDEATHSIG); elsewhere, and as a backstop, the loops poll `parent_alive`.
From outside (tests, benchmarks that launch `appliance run`), `stage_children` names a supervisor's stages and
`alive` tells whether one is still running, `session_members` what still runs in a session (Linux /proc).
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


def stage_children(pid: int) -> dict[int, str]:
    """pid -> stage name of a supervisor's children (the name follows the module in each command line)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and b"appliance.runtime.stage" in cmd:
            found[int(entry)] = cmd[cmd.index(b"appliance.runtime.stage") + 1].decode()
    return found


def alive(pid: int) -> bool:
    """Whether pid runs (a zombie counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def session_members(sid: int) -> list[int]:
    """pids still running (not zombies) in session sid: what a launcher started with start_new_session left."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(entry))
    return out
