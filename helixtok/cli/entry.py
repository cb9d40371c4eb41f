"""The `helixtok` command's first instructions: a Ctrl-C while Python imports the command line exits 130 with one line."""

import os
import signal
import sys


def _early(signum, frame):  # nothing has started yet: nothing to stop or resume
    sys.stderr.write("\ninterrupted before anything started\n")
    sys.stderr.flush()
    os._exit(128 + signum)


def guard() -> bool:
    """Ctrl-C exits 130 with one line until release(); not where Ctrl-C is ignored (nohup, &)."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _early)
        return True
    return False


def release(guarded: bool) -> None:
    if guarded:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def quiet_shutdown() -> None:
    """The command has ended (its result printed): a Ctrl-C from now on, while the interpreter
    shuts down (joining threads, running atexit), ends it by the signal, with no traceback from
    inside Python's own shutdown code."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def keep_interrupts() -> None:
    """A Ctrl-C that lands while an object's finalizer (__del__) runs is, for Python, an exception
    it cannot raise there: it prints 'Exception ignored in ... KeyboardInterrupt' and drops it (the
    Ctrl-C stress test saw one, in a ZipFile's __del__, and the build then went on).  Here it is sent
    again, from a timer thread a moment later (sent at once, it would land in this hook itself), and
    stops the command as any Ctrl-C does."""
    import threading

    default = sys.unraisablehook

    def hook(unraisable):
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            again = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGINT))
            again.daemon = True
            again.start()
            return
        default(unraisable)
    sys.unraisablehook = hook


def main():
    guarded = guard()
    keep_interrupts()
    from .app import main as cli

    release(guarded)
    try:
        return cli()
    finally:
        quiet_shutdown()
