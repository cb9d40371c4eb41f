"""The `helixtok` command's first instructions: a Ctrl-C while Python imports the command line exits 130 with one line."""

import os
import signal
import sys


def main():
    def early(signum, frame):  # nothing has started yet: nothing to stop or resume
        sys.stderr.write("\ninterrupted before anything started\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where Ctrl-C is ignored (nohup, &)
        signal.signal(signal.SIGINT, early)
        from .cli import main as cli

        signal.signal(signal.SIGINT, signal.default_int_handler)
    else:
        from .cli import main as cli
    return cli()
