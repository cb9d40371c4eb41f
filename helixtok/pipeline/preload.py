"""fastokens' tokenizer loaded in a thread ahead of its use (by the command line before its own imports: no numpy here)."""

from __future__ import annotations

import contextlib
import glob
import os
import threading
from importlib.util import find_spec

from ..format.errors import ConfigError
from .config import worker_bytes

# A build that tokenizes in its own process waits for this load (1.0 s for a 100k vocabulary)
# before its first unit; fastokens releases the GIL while it loads, so started before numpy and
# the rest of helixtok are imported (0.2-0.3 s) it finishes that much earlier.  The file is read
# here, once: the build takes these very bytes (take_bytes) instead of reading it again.
_early: dict[str, tuple[threading.Thread, list]] = {}  # sha256 of the bytes -> (load, [tokenizer])
_read: dict[tuple, bytes] = {}  # file key -> the bytes start() read
SCAN_FILES = 2000  # inputs looked at to guess a build's size: past this, no guess


def _key(path: str) -> tuple:
    st = os.stat(path)
    return os.path.realpath(path), st.st_mtime_ns, st.st_size, st.st_ino


def start(path: str) -> None:
    """Read `path` and load fastokens' tokenizer of those bytes ahead (start_bytes); the build
    takes the bytes (take_bytes) as its one read of the file."""
    key = _key(path)
    if key not in _read:
        with open(path, "rb") as fh:
            _read[key] = fh.read()
    start_bytes(_read[key])


def start_bytes(data: bytes) -> None:
    """Load fastokens' tokenizer of `data` in a thread, unless one is loading it; `take` hands it
    over.  fastokens releases the GIL while it loads: the build meanwhile imports, plans,
    inspects the tokenizer (tokenizers' own load) and samples the corpus."""
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    if sha in _early:
        return
    box: list = []

    def load() -> None:
        with contextlib.suppress(Exception):  # the build loads it again and says why it cannot
            import fastokens

            box.append(fastokens.Tokenizer.from_json_str(data.decode("utf-8")))
    # Not a daemon: a daemon thread still inside the library when Python shuts down aborts it.
    t = threading.Thread(target=load, name="helixtok-preload")
    _early[sha] = (t, box)
    t.start()


def take_bytes(path: str) -> bytes | None:
    """The bytes `start` read of `path`, if the file is still the one it read (inode, size, mtime)."""
    try:
        return _read.pop(_key(path))
    except (KeyError, OSError):
        return None


def take(sha: str):
    """The tokenizer loaded ahead from bytes whose sha256 is `sha` (once it is loaded), else None."""
    try:
        t, box = _early.pop(sha)
    except KeyError:
        return None
    t.join()
    return box[0] if box else None


def drop() -> None:
    """Wait for the loads started and forget what they loaded (a build that did not use them)."""
    _read.clear()
    while _early:
        _early.popitem()[1][0].join()


def speculate(corpus: list[str], tokenizer: str, workers: int, backend: str) -> None:
    """Start loading fastokens' tokenizer now if the build will likely tokenize in this process
    with it: --workers 1, or local inputs of at most one worker's share (config.worker_bytes).
    A wrong guess costs a core-second of loading and nothing else: the tokenizer is dropped."""
    if backend not in ("auto", "fastokens") or find_spec("fastokens") is None:
        return
    path = os.path.join(tokenizer, "tokenizer.json") if os.path.isdir(tokenizer) else tokenizer
    if not os.path.isfile(path):
        return  # a HF repo id, or an error the build reports
    if workers != 1 and not _fits_one_process(corpus):
        return
    start(path)


def _fits_one_process(corpus: list[str]) -> bool:
    """Whether the local inputs hold at most one fastokens worker's share, counting files as they
    are on disk (a compressed one holds more: the guess may be wrong, at the cost above)."""
    try:
        limit = worker_bytes("fastokens")
    except ConfigError:
        return False  # the build says what is wrong with it
    total = seen = 0
    for arg in corpus:
        found = False
        for p in [arg] if os.path.exists(arg) else glob.iglob(arg, recursive=True):  # lazily: stops early
            found = True
            for d, _, names in os.walk(p) if os.path.isdir(p) else [("", [], [p])]:
                for n in names:
                    seen += 1
                    with contextlib.suppress(OSError):
                        total += os.path.getsize(os.path.join(d, n))
                    if total > limit or seen > SCAN_FILES:
                        return False
        if not found:
            return False  # a URL, or a path the build will say is missing: no load to wait for
    return True
