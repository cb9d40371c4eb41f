"""Shard files: a work unit's tokens written where they stay (temp file, hashed as written, fsync, rename)."""

from __future__ import annotations

import functools
import hashlib
import os
import queue
import sys
import threading

import numpy as np

from . import limits

VALID_DTYPE = np.dtype("<u4")  # per-chunk count of real (non-pad) tokens: document packing
DOCS_DTYPE = np.dtype("<u8")  # token offsets within the shard where a document (or piece) starts
MASK_DTYPE = np.dtype("u1")  # per token of a chat build: 1 where it trains, 0 elsewhere (padding too)
SRC_DTYPE = np.dtype("<u4")  # per document (as .docs): where in its work unit it was read (docs/format.md)


def _tmp_of(final: str) -> str:
    return os.path.join(os.path.dirname(final), "." + os.path.basename(final) + ".tmp")


class _Sha256Behind:
    """sha256 of the buffers given, in order, computed in a thread of its own (hashlib releases the
    GIL on large buffers), so that hashing overlaps the tokenizing of the next batch.  Holds at
    most limits.QUEUED_BYTES of buffers not yet hashed; `digest` waits for the thread to catch up."""

    def __init__(self):
        self.sha = hashlib.sha256()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._queued = 0  # bytes handed over and not yet hashed
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closing = False  # drop what is still queued

    def update(self, buf: memoryview) -> None:
        if self._thread is None and buf.nbytes < (1 << 16):  # a hand-over costs more than hashing a small one
            self.sha.update(buf)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="helixtok-sha256", daemon=True)
            self._thread.start()
        self._wait(limits.QUEUED_BYTES - buf.nbytes)
        with self._cond:
            self._queued += buf.nbytes
        self._queue.put(buf)  # a view: the caller never writes into an array it handed over

    def _wait(self, at_most: int) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._queued <= max(0, at_most) or self._error is not None)
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (buf := self._queue.get()) is not None:
            try:
                if self._error is None and not self._closing:
                    self.sha.update(buf)
            except BaseException as e:  # noqa: BLE001 - raised in the writer's thread (update, digest)
                self._error = e
            with self._cond:
                self._queued -= buf.nbytes
                self._cond.notify_all()

    def digest(self) -> str:
        self._wait(0)
        return self.sha.hexdigest()

    def close(self) -> None:
        """End the thread (what it has not hashed is dropped)."""
        if self._thread is not None:
            self._closing = True
            self._queue.put(None)
            self._thread.join()
            self._thread = None


WRITEBACK_BYTES = 1 << 20  # written since the last start of write-back


@functools.lru_cache(maxsize=1)
def start_writeback():
    """Linux's sync_file_range(fd, start, n, SYNC_FILE_RANGE_WRITE): starts writing a range of a
    file back to disk without waiting for it, so the fsync at commit finds little left to write
    (160 files of 2.9 MB: fsync waits 0.22-0.30 s in all, 0.10 s with it).  None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return fn


class HashedFile:
    """A temp file whose bytes are hashed as written; `commit` fsyncs and renames it into place."""

    def __init__(self, final: str, durable: bool = True):
        self.final, self.tmp, self.durable = final, _tmp_of(final), durable
        self.fh = open(self.tmp, "wb")
        self.hasher = _Sha256Behind()
        self.bytes = 0
        self._behind = 0  # bytes up to which write-back has been started

    def write(self, arr: np.ndarray) -> None:
        buf = np.ascontiguousarray(arr).data
        self.fh.write(buf)
        self.hasher.update(buf)
        self.bytes += buf.nbytes
        if self.durable and self.bytes - self._behind >= WRITEBACK_BYTES and (start := start_writeback()) is not None:
            self.fh.flush()
            start(self.fh.fileno(), self._behind, self.bytes - self._behind, 2)  # only a hint: its result does not matter
            self._behind = self.bytes

    def commit(self) -> dict:
        """Durable under its final name: {"bytes", "sha256"}."""
        try:
            sha = self.hasher.digest()
        finally:
            self.hasher.close()
        self.fh.flush()
        if self.durable:
            os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.final)
        return {"bytes": self.bytes, "sha256": sha}

    def abort(self) -> None:
        self.hasher.close()
        self.fh.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


class HeldIds:
    """A work unit's ids kept in memory, up to `limit` bytes, so that they are written once: where
    they belong in their group's shard, when their place is known as the unit ends (join.place_unit, `held`).
    Past the limit, or when their place is not known yet, they go to the file `final`
    (a HashedFile) instead: `spill`."""

    def __init__(self, final: str, limit: int, durable: bool):
        self.final, self.limit, self.durable = final, limit, durable
        self.parts: list[np.ndarray] = []  # the arrays given (fresh from the encoder: never written into again)
        self.bytes = 0
        self.file: HashedFile | None = None

    def write(self, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr)
        if self.file is None and self.bytes + arr.nbytes > self.limit:
            self._to_file()
        if self.file is not None:
            self.file.write(arr)
        else:
            self.parts.append(arr)
        self.bytes += arr.nbytes

    def _to_file(self) -> None:
        self.file = HashedFile(self.final, self.durable)
        for a in self.parts:
            self.file.write(a)
        self.parts = []

    @property
    def held(self) -> bool:
        return self.file is None

    def commit(self) -> dict:
        """{"bytes"} while held, else the file's {"bytes", "sha256"}."""
        return {"bytes": self.bytes} if self.file is None else self.file.commit()

    def spill(self) -> dict:
        """The held ids into the file, after all: its {"bytes", "sha256"}."""
        self._to_file()
        return self.file.commit()

    def blocks(self):
        """The held ids as byte views, in order (no copy)."""
        for a in self.parts:
            yield memoryview(a).cast("B")

    def abort(self) -> None:
        self.parts = []
        if self.file is not None:
            self.file.abort()


class ShardFiles:
    """One split's tokens (a work unit's output, or an imported Megatron dataset) in files of at
    most `cap` tokens (a multiple of seq_len), each with its sidecars (`sides`: "docs" and/or
    "valid").

    A file is written under `stem.NNNN.bin` (and .docs/.valid) in the folder given, and its
    final name is `final-NNNN.bin`: what `close` returns says both.
    """

    def __init__(self, stem: str, final: str, dtype: np.dtype, seq_len: int, cap: int, sides: tuple[str, ...],
                 durable: bool = True, hold: int = 0):
        self.stem, self.final, self.dtype, self.seq_len, self.cap, self.sides = stem, final, dtype, seq_len, cap, sides
        self.durable = durable
        self.hold = hold  # a unit's output: its ids kept in memory up to this many bytes (HeldIds)
        self.held: HeldIds | None = None  # the last shard's ids, still in memory once closed
        self.tokens = 0  # written so far, over all shards
        self.shards: list[dict] = []  # committed: manifest entries with "state" names beside
        self._open: dict[str, HashedFile] | None = None
        self._in = 0  # tokens in the open shard
        self._docs = 0  # document starts in the open shard

    def _names(self, ext: str) -> tuple[str, str]:
        k = len(self.shards)
        return f"{self.stem}.{k:04d}.{ext}", f"{self.final}-{k:04d}.{ext}"

    def write(self, ids: np.ndarray, starts: np.ndarray | None = None, valid: np.ndarray | None = None,
              mask: np.ndarray | None = None, src: np.ndarray | None = None) -> None:
        """ids: the next tokens; starts: sorted offsets (from ids[0]) where documents start;
        valid: per chunk, when ids are whole chunks; mask: per token (a chat build's: 1 trains);
        src: per document start, where it was read (its .src entry)."""
        done, n, L = 0, len(ids), self.seq_len
        while done < n:
            if self._open is None:
                self._open = {ext: HashedFile(self._names(ext)[0], self.durable) for ext in self.sides}
                name = self._names("bin")[0]
                self._open["bin"] = HeldIds(name, self.hold, self.durable) if self.hold else HashedFile(name, self.durable)
                self._in = self._docs = 0
            take = min(self.cap - self._in, n - done)
            self._open["bin"].write(ids[done: done + take].astype(self.dtype, copy=False))
            if starts is not None and "docs" in self._open:
                a, b = np.searchsorted(starts, [done, done + take])
                self._open["docs"].write((starts[a:b] - done + self._in).astype(DOCS_DTYPE))
                self._docs += int(b - a)
                if "src" in self._open:  # (a writer that keeps sources gives one per document start)
                    self._open["src"].write(np.asarray(src[a:b], dtype=SRC_DTYPE))
            if mask is not None and "mask" in self._open:
                self._open["mask"].write(mask[done: done + take].astype(MASK_DTYPE, copy=False))
            if valid is not None and "valid" in self._open:
                self._open["valid"].write(valid[done // L: (done + take) // L].astype(VALID_DTYPE, copy=False))
            self._in += take
            self.tokens += take
            done += take
            if self._in == self.cap:
                self._commit()

    def _commit(self) -> None:
        files = {ext: f.commit() for ext, f in self._open.items()}
        ids = self._open["bin"]
        self.held = ids if isinstance(ids, HeldIds) and ids.held else None
        state, final = self._names("bin")
        e = {"path": os.path.basename(final), "state": os.path.basename(state), **files["bin"], "num_tokens": self._in}
        for ext in self.sides:
            s, f = self._names(ext)
            e[ext] = {"path": os.path.basename(f), "state": os.path.basename(s), **files[ext]}
            if ext == "docs":
                e[ext]["count"] = self._docs
        self.shards.append(e)
        self._open = None

    def close(self) -> list[dict]:
        if self._open is not None:
            self._commit()
        return self.shards

    def abort(self) -> None:
        for f in (self._open or {}).values():
            f.abort()
        self._open = None
