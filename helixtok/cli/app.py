"""The helixtok command line: a thin click layer over the library; results on stdout, progress on stderr.

Its commands, by what they read: build.py (a corpus: build, train-tokenizer), inspect.py (a dataset:
show, info, stats, verify, bench-read), transfer.py (datasets joined, moved or converted: merge,
repack, push, pull, export, import).
"""

from __future__ import annotations

import click

from ..version import __version__
from . import build, inspect, transfer


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
                 inspect.bench_read, transfer.merge, transfer.repack, transfer.push, transfer.pull, transfer.export, transfer.import_):
    main.add_command(_command)
