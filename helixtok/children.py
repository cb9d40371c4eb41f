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


def start_helper(code: str, *args: str, **popen) -> subprocess.Popen:
    """`python -c code args` in a process that dies with this one and imports the helixtok this
    process runs: not a multiprocessing child, which would import the caller's __main__ again.
    Raises OSError where no interpreter can be started (embedded Python)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)}
    prelude = f"from helixtok.children import die_with_parent\ndie_with_parent({os.getpid()})\n"
    return subprocess.Popen([sys.executable, "-c", prelude + code, *args], env=env, stdin=subprocess.DEVNULL, **popen)
