"""Processes a build starts beside itself (workers, helpers): each dies with the build."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def die_with_parent(parent: int) -> None:
    """Exit as soon as the build process is gone, even while blocked waiting for work.

    An orphan that went on writing could race a resumed build; on Linux the kernel kills us
    (PR_SET_PDEATHSIG: when the thread that started us ends), elsewhere a thread polls.  The
    parent may have died before this ran.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        ok = False
    if os.getppid() != parent:
        os._exit(1)
    if not ok:
        import threading

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(0.5)
            os._exit(1)

        threading.Thread(target=watch, daemon=True).start()


def start_helper(code: str, *args: str, env_extra: dict | None = None, **popen) -> subprocess.Popen:
    """`python -c code args` in a process that dies with this one and imports the helixtok this
    process runs: not a multiprocessing child, which would import the caller's __main__ again.
    Raises OSError where no interpreter can be started (embedded Python)."""
    here = os.path.abspath(__file__)
    for _ in range(__name__.count(".") + 1):  # up to the folder that holds the helixtok package
        here = os.path.dirname(here)
    env = {**os.environ, **(env_extra or {}), "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    prelude = f"from helixtok.pipeline.children import die_with_parent\ndie_with_parent({os.getpid()})\n"
    popen.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen([sys.executable, "-c", prelude + code, *args], env=env, **popen)


def _cpu_ticks(pid: int) -> int | None:
    """CPU time a process has used (user + system clock ticks), from /proc; None where there is none."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


def communicate_while_alive(proc: subprocess.Popen, stall: float, what: str) -> tuple:
    """proc.communicate(), failing once the helper has used no CPU for `stall` s (stopped, or stuck
    in a read): its work is all computation, so a helper that computes nothing is not working."""
    from ..format.errors import HelixtokError

    ticks, last = _cpu_ticks(proc.pid), time.monotonic()
    while True:
        try:
            return proc.communicate(timeout=0.5)
        except subprocess.TimeoutExpired:
            now = _cpu_ticks(proc.pid)
            if now is None or now != ticks:  # None: no /proc here, so no telling: wait on
                ticks, last = now, time.monotonic()
            elif time.monotonic() - last > stall:
                proc.kill()
                proc.communicate()
                raise HelixtokError(f"no progress for {stall:g} s from the process {what}; rerun the same command "
                                    "(or raise --stall-timeout)") from None
