"""The helixtok command line: a thin click layer over the library; results on stdout, progress on stderr.

Its commands, by what they read: commands/build.py (a corpus: build, train-tokenizer),
commands/inspect.py (a dataset: show, info, stats, verify, bench-read), commands/transfer.py
(datasets joined, moved or converted: merge, push, pull, export, import).
"""

from __future__ import annotations

if __name__ == "__main__":  # `python -m helixtok.cli`: the helixtok command's guard while it imports (entry.py)
    from helixtok.entry import guard as _guard

    _guarded = _guard()

import click

from . import __version__
from .commands import build, inspect, transfer


# The code's own version, not the installed metadata's: an editable install keeps the version it
# was installed at (it said 0.2.0 for 0.3.0's code) until it is installed again.
@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version=__version__, prog_name="helixtok")
def main():
    """Pre-tokenize text corpora into memory-mappable token shards with exact counts.

    \b
    Example:
      helixtok build corpus/ out/ --tokenizer tokenizer.json --seq-len 2048
      helixtok stats out/ --batch-size 16 --grad-accum 4 --world-size 8
    """


for _command in (build.build, build.train_tokenizer, inspect.show, inspect.info, inspect.stats, inspect.verify,
                 inspect.bench_read, transfer.merge, transfer.push, transfer.pull, transfer.export, transfer.import_):
    main.add_command(_command)


if __name__ == "__main__":
    from helixtok.entry import quiet_shutdown, release

    release(_guarded)
    try:
        main()
    finally:
        quiet_shutdown()
