"""Shard writer: whole chunks into <split>-NNNNN.bin (temp file + fsync + rename), with sidecars."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from dataclasses import dataclass, field

import numpy as np

VALID_DTYPE = np.dtype("<u4")  # per-chunk count of real (non-pad) tokens, document packing
DOCS_DTYPE = np.dtype("<u8")  # token offsets within the shard where a document starts, packed


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _tmp_of(final: str) -> str:
    return os.path.join(os.path.dirname(final), "." + os.path.basename(final) + ".tmp")


class _Sha256Behind:
    """sha256 of the buffers given, in order, computed in a thread of its own (hashlib releases the
    GIL on large buffers): hashing was two thirds of the assembly's time, and the assembly is the
    one sequential stage of a build (scripts/bench_assembly.py).  Holds at most QUEUED_BYTES of
    buffers not yet hashed (two of the assembly's 16 MiB slices: enough to overlap; the buffers
    keep arrays or mapped pages alive); `digest_now` waits for the thread to catch up."""

    QUEUED_BYTES = 32 << 20

    def __init__(self, sha=None):
        self.sha = sha or hashlib.sha256()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._queued = 0  # bytes handed over and not yet hashed
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._closing = False  # drop what is still queued

    def update(self, buf: memoryview) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="helixtok-sha256", daemon=True)
            self._thread.start()
        with self._cond:
            self._cond.wait_for(lambda: self._queued < self.QUEUED_BYTES or self._error is not None)
            self._check()
            self._queued += buf.nbytes
        self._queue.put(buf)  # a view: the caller never writes into an array it handed over

    def _run(self) -> None:
        while (buf := self._queue.get()) is not None:
            try:
                if self._error is None and not self._closing:
                    self.sha.update(buf)
            except BaseException as e:  # noqa: BLE001 - raised in the writer's thread (update, digest_now)
                self._error = e
            with self._cond:
                self._queued -= buf.nbytes
                self._cond.notify_all()

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    def digest_now(self):
        """The hash object of everything given so far (a copy: hashing goes on after it)."""
        with self._cond:
            self._cond.wait_for(lambda: self._queued == 0)
        self._check()
        return self.sha.copy()

    def close(self) -> None:
        """End the thread (what it has not hashed is dropped: call digest_now first to keep it)."""
        if self._thread is not None:
            self._closing = True
            self._queue.put(None)
            self._thread.join()
            self._thread = None


class _HashedFile:
    """A temp file whose bytes are hashed as written; `commit` fsyncs and renames it into place."""

    def __init__(self, final: str, fh=None, sha=None, size: int = 0):
        """A new temp file; or (reopen) `fh` open on it, holding `size` bytes whose hash is `sha`."""
        self.final, self.tmp = final, _tmp_of(final)
        self.fh = fh if fh is not None else open(self.tmp, "wb")
        self.hasher = _Sha256Behind(sha)
        self.bytes = size

    def write(self, arr: np.ndarray) -> None:
        buf = np.ascontiguousarray(arr).data
        self.fh.write(buf)
        self.hasher.update(buf)
        self.bytes += buf.nbytes

    def commit(self) -> dict:
        sha = self.hasher.digest_now()
        self.hasher.close()
        self.fh.flush()
        os.fsync(self.fh.fileno())
        self.fh.close()
        os.replace(self.tmp, self.final)
        return {"path": os.path.basename(self.final), "bytes": self.bytes, "sha256": sha.hexdigest()}

    def abort(self) -> None:
        self.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)

    def close(self) -> None:
        """Stop writing, keeping what was written (a resumed build reopens it)."""
        self.hasher.close()
        self.fh.close()

    def mark(self) -> list:
        """[bytes written, their sha256]: flushed into the file, where `reopen` finds them."""
        self.fh.flush()
        return [self.bytes, self.hasher.digest_now().hexdigest()]

    @classmethod
    def reopen(cls, final: str, mark: list) -> "_HashedFile | None":
        """The file a stopped build was writing, cut back to `mark` (its bytes hashed again), to
        write on; None if it does not hold those bytes (they never reached the disk)."""
        tmp = _tmp_of(final)
        if not os.path.exists(tmp) and os.path.exists(final):
            os.replace(final, tmp)  # it was committed after the mark: written on since
        try:
            fh = open(tmp, "r+b")
        except FileNotFoundError:
            return None
        size, want = mark
        sha, got = hashlib.sha256(), 0
        if os.fstat(fh.fileno()).st_size >= size:
            fh.truncate(size)
            while got < size and (block := fh.read(min(8 << 20, size - got))):
                sha.update(block)
                got += len(block)
        if got != size or sha.hexdigest() != want:
            fh.close()
            return None
        return cls(final, fh, sha, size)


@dataclass
class ShardWriter:
    """Writes one split's chunks; shards hold `chunks_per_shard` chunks (the last fewer)."""

    out_dir: str
    split: str
    dtype: np.dtype
    seq_len: int
    chunks_per_shard: int
    sidecar: str  # "valid" (document packing) or "docs" (packed)
    shards: list[dict] = field(default_factory=list)
    num_chunks: int = 0
    _bin: _HashedFile | None = None
    _side: _HashedFile | None = None
    _in_shard: int = 0
    _docs_in_shard: int = 0

    def _stem(self) -> str:
        """The open (or next) shard's path without its extension."""
        return os.path.join(self.out_dir, f"{self.split}-{len(self.shards):05d}")

    def _open(self) -> None:
        stem = self._stem()
        self._bin = _HashedFile(stem + ".bin")
        self._side = _HashedFile(f"{stem}.{self.sidecar}")
        self._in_shard = 0
        self._docs_in_shard = 0

    def _close(self) -> None:
        entry = self._bin.commit()
        entry["num_chunks"] = self._in_shard
        side = self._side.commit()
        side.pop("bytes")
        if self.sidecar == "docs":
            side["count"] = self._docs_in_shard
        entry[self.sidecar] = side
        self.shards.append(entry)
        self._bin = self._side = None

    def write(self, chunks: np.ndarray, valid: np.ndarray | None = None, doc_starts: np.ndarray | None = None
              ) -> None:
        """chunks [k, seq_len]; valid [k] (document packing) or doc_starts: sorted offsets of
        document starts counted from the first token of `chunks` (packed)."""
        done = 0
        k = len(chunks)
        while done < k:
            if self._bin is None:
                self._open()
            take = min(self.chunks_per_shard - self._in_shard, k - done)
            self._bin.write(chunks[done: done + take].astype(self.dtype, copy=False))
            if valid is not None:
                self._side.write(valid[done: done + take].astype(VALID_DTYPE, copy=False))
            if doc_starts is not None:
                lo, hi = done * self.seq_len, (done + take) * self.seq_len
                a, b = np.searchsorted(doc_starts, [lo, hi])
                offs = doc_starts[a:b] - lo + self._in_shard * self.seq_len
                self._side.write(offs.astype(DOCS_DTYPE))
                self._docs_in_shard += int(b - a)
            self._in_shard += take
            self.num_chunks += take
            done += take
            if self._in_shard == self.chunks_per_shard:
                self._close()

    def finish(self) -> list[dict]:
        if self._bin is not None:
            self._close()
        return self.shards

    def abort(self) -> None:
        for f in (self._bin, self._side):
            if f is not None:
                f.abort()

    def stop(self) -> None:
        """Close the files being written, keeping them: a resumed build reopens them (reopen)."""
        for f in (self._bin, self._side):
            if f is not None:
                f.close()
        self._bin = self._side = None

    def mark(self) -> dict:
        """Where this writer stands, flushed to its files: what `reopen` needs to go on from here."""
        return {"shards": [dict(e) for e in self.shards], "num_chunks": self.num_chunks, "in_shard": self._in_shard,
                "docs_in_shard": self._docs_in_shard, "bin": self._bin and self._bin.mark(),
                "side": self._side and self._side.mark()}

    def reopen(self, mark: dict) -> bool:
        """Go on from `mark` (a writer made with the same arguments); False if the files on disk
        do not hold what it records (then nothing is usable)."""
        for e in mark["shards"]:
            side_bytes = (e["num_chunks"] * VALID_DTYPE.itemsize if self.sidecar == "valid"
                          else e["docs"]["count"] * DOCS_DTYPE.itemsize)
            for name, size in ((e["path"], e["bytes"]), (e[self.sidecar]["path"], side_bytes)):
                path = os.path.join(self.out_dir, name)
                if not os.path.isfile(path) or os.path.getsize(path) != size:  # committed: fsynced first
                    return False
        self.shards = [dict(e) for e in mark["shards"]]
        self.num_chunks, self._in_shard, self._docs_in_shard = (mark["num_chunks"], mark["in_shard"],
                                                                mark["docs_in_shard"])
        if mark["bin"] is not None:
            stem = self._stem()
            self._bin = _HashedFile.reopen(stem + ".bin", mark["bin"])
            self._side = _HashedFile.reopen(f"{stem}.{self.sidecar}", mark["side"])
            if self._bin is None or self._side is None:
                self.stop()
                return False
        return True
