"""The size thresholds that choose a code path, in one place, lowerable for tests ($HELIXTOK_TEST_LIMITS).

Each threshold picks *how* something is done (held in memory or written to a file first, read whole
or in ranges, in one piece or several), not the token stream written: a build gives the same ids on
either side of each (tests/test_paths.py builds one corpus with them lowered and with none).  Three
are recorded where they matter: LONG_DOC_BYTES and PIECE_CHARS are the defaults of BuildConfig
fields (in the plan), and SHARD_LIMIT decides where a group's stream is cut into shard files (the
manifest lists them).
Small test corpora never cross the real values, so a test lowers them: in its own process with
monkeypatch (`limits.HOLD_BYTES = 1000`: read where used, at call time), and for the processes a
build starts (a CLI run, spawned helpers, Ray tasks) through the environment, read when this module
is imported:

    HELIXTOK_TEST_LIMITS="HOLD_BYTES=4096,RANGE_MIN_BYTES=1,SPLIT_BYTES=1" helixtok build ...

Not a user option: the defaults are what is measured and documented.
"""

from __future__ import annotations

import os

# A work unit's ids kept in memory up to this size, to be written once, into their group's shard,
# as the unit ends (a 4 MiB unit of text gives ~4 MB of uint32 ids); a larger output goes to a file
# first and is copied into place (pipeline/unit.py, pipeline/join.py).
HOLD_BYTES = 16 << 20
# A .gz/.zst file is read by several workers (in line-aligned ranges of its decompressed text) from
# this many compressed bytes, when it also holds 1/SPLIT_SHARE of the corpus's compressed bytes;
# else one worker reads it whole (pipeline/units.py).
SPLIT_BYTES = 32 << 20
SPLIT_SHARE = 64
RANGE_MIN_BYTES = 32 << 20  # decompressed bytes per range of such a file, at least
# Documents larger than this are read in pieces of about PIECE_BYTES (memory stays flat:
# pipeline/longdoc.py); the default of BuildConfig.long_doc_bytes.
LONG_DOC_BYTES = 8 << 20
PIECE_BYTES = 1 << 20
# Documents longer than this (in characters) are encoded in pieces cut before a space (its value is
# part of the plan: docs/format.md); the default of BuildConfig.max_piece_chars.
PIECE_CHARS = 200_000
SHARD_LIMIT = 2  # no shard holds more than SHARD_LIMIT x --shard-size bytes: a group's stream goes on in pieces
# A shard's segments (each with its sha256: what a reader fetches and checks, docs/format.md) end at
# every multiple of this many bytes of it, besides where work units meet: a reader's fetches stay
# near its block size whatever the input's form made a unit (a whole .jsonl.gz: 45 MB and more).
# It decides the manifest's segment lists (~75 bytes of JSON a segment: 1 GB of ids, ~1,000).
SEGMENT_BYTES = 1 << 20
QUEUED_BYTES = 32 << 20  # buffers handed to a hashing thread and not hashed yet, at most (format/shards.py)
# One conversation's rendering is stopped past these (a hostile template or row: skipped, counted
# as not_a_conversation): far above any real one (a 128k-token context is ~0.5M characters).
RENDER_SECONDS = 10
RENDER_CHARS = 64 << 20

NAMES = ("HOLD_BYTES", "SPLIT_BYTES", "SPLIT_SHARE", "RANGE_MIN_BYTES", "LONG_DOC_BYTES", "PIECE_BYTES",
         "PIECE_CHARS", "SHARD_LIMIT", "SEGMENT_BYTES", "QUEUED_BYTES", "RENDER_SECONDS", "RENDER_CHARS")


def lowered(spec: str) -> dict[str, int]:
    """The thresholds a $HELIXTOK_TEST_LIMITS value sets ("NAME=INT,..."), checked."""
    out = {}
    for item in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in NAMES or not value.strip().isdigit():
            raise ValueError(f"HELIXTOK_TEST_LIMITS: {item!r} is not NAME=WHOLE_NUMBER with NAME one of "
                             f"{', '.join(NAMES)}")
        out[name] = int(value)
    return out


globals().update(lowered(os.environ.get("HELIXTOK_TEST_LIMITS", "")))
