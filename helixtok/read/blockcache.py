"""A dataset's token bytes in object storage, fetched by range GETs into a node-local cache every process shares.

The cache holds a shard's **segments** (docs/format.md: each a work unit's ids in the shard, with
the sha256 the build recorded as it wrote them), so every cached byte is checked against a digest
made at build time and nothing new is recorded. A **block** is a run of consecutive segments of
at least `block_bytes`: the unit of a GET when a sampler's order is known (prefetch), and of block
shuffle (sampler.py). Segments land in `cache_dir/<dataset>/` as a temp file renamed into place,
one process per node fetching each (an flock: the others wait, then read the file); a process
checks a segment's sha256 when it first maps it (a damaged cached one is fetched again); above
`cache_limit` the least recently used files go (a process that has one mapped keeps its pages).
Counts (hits, misses, GETs, bytes) are per process: `BlockCache.counts`.
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import hashlib
import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..format.errors import DatasetError
from ..format.objstore import current_stall, redact, storage_errors, watched_filesystem
from .sizes import parse_bytes

DEFAULT_BLOCK_BYTES = 64 << 20
OPEN_BLOCKS = 64  # at most this many blocks mapped (and checked) by a process: a window of block shuffle fits
PREFETCH_THREADS = 4


@dataclass(frozen=True)
class Segment:
    """Bytes [start, end) of one shard whose sha256 the build recorded (docs/format.md `segments`)."""

    path: str  # the shard's path, relative to the dataset's root
    start: int
    end: int
    sha256: str


@dataclass(frozen=True)
class Block:
    """Consecutive segments of one shard fetched with one range GET, with the next block's first
    segment (`tail`: what the chunk running over this block's end reads; None at a shard's end)."""

    segments: tuple[Segment, ...]
    tail: Segment | None = None

    @property
    def start(self) -> int:
        return self.segments[0].start


def plan_blocks(entry: dict, block_bytes: int) -> list[Block]:
    """A shard's blocks: consecutive segments, a block closing once it holds >= block_bytes (a shard
    without segments, format 3 and older: one block, checked by the whole file's sha256)."""
    segs = entry.get("segments") or [[entry["bytes"], entry["sha256"]]]
    out, run, at, size = [], [], 0, 0
    for n, sha in segs:
        run.append(Segment(entry["path"], at + size, at + size + int(n), sha))
        size += int(n)
        if size >= block_bytes:
            out.append(Block(tuple(run)))
            at, run, size = at + size, [], 0
    if run:
        out.append(Block(tuple(run)))
    return [Block(b.segments, nxt.segments[0]) for b, nxt in zip(out, out[1:])] + out[-1:]


class BlockCache:
    """Segments of the dataset at `root` (a URL) in `cache_dir`, at most `limit` bytes of them on disk.

    A read needs the segments it covers and fetches the missing ones (one GET per run of them); a
    prefetch fetches the missing segments of whole blocks with their tails (the next block's first
    segment, which the chunk running over the block's end reads) in one GET. A tail evicted
    before its own block is read is fetched again: block shuffle fetches up to (1 + a segment /
    a block) times the data an epoch, with a cache smaller than the data."""

    def __init__(self, root: str, cache_dir: str, key: str, limit: int | None = None, block_bytes: int = 0,
                 stall: float | None = None):
        self.root, self.cache_dir, self.key, self.limit = root.rstrip("/"), cache_dir, key, limit
        self.stall = current_stall() if stall is None else stall  # each GET's bound (objstore.Watched)
        # Bytes this process keeps mapped: a deleted segment's disk space is freed only once no
        # process maps it, so a process keeps at most half the limit mapped (and OPEN_BLOCKS blocks).
        self.open_bytes = OPEN_BLOCKS * block_bytes if limit is None else max(2 * block_bytes, limit // 2)
        self.block_bytes = block_bytes
        self.dir = os.path.join(cache_dir, key)
        os.makedirs(os.path.join(self.dir, ".locks"), exist_ok=True)
        self.counts = {"hits": 0, "misses": 0, "gets": 0, "bytes_fetched": 0, "refetched_damaged": 0}
        self._reset()

    def _reset(self) -> None:
        self._fs = None
        self._maps: OrderedDict[Segment, np.ndarray] = OrderedDict()
        self._mapped = 0
        self._read: set[Segment] = set()  # segments this process has read (their use stamped)
        self._holders: dict[Segment, list[tuple[list, int]]] = {}  # who keeps a mapped segment's ids
        self._inflight: dict[Block, Future] = {}
        self._mu = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def __getstate__(self) -> dict:  # a DataLoader worker gets the settings, not the maps or threads
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        self.counts = dict.fromkeys(self.counts, 0)
        self._reset()

    @property
    def fs(self):
        if self._fs is None:
            self._fs = watched_filesystem(self.root, self.stall)[0]
        return self._fs

    def _url(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def _file(self, rel: str, start: int | None = None, end: int | None = None) -> str:
        name = rel.replace("/", "__")
        return os.path.join(self.dir, name if start is None else f"{name}.{start:013d}-{end:013d}")

    @property
    def prefetch_blocks(self) -> int:
        """Blocks a prefetch may ask for at once (the rest of the mapped bytes: what is being read)."""
        return max(1, self.open_bytes // max(1, 2 * self.block_bytes))

    # ------------------------------------------------------------------ segments

    def read(self, segs: list[Segment], a: int, b: int) -> np.ndarray:
        """Bytes [a, b) of a shard, from its segments `segs` that cover them (in order)."""
        parts = []
        for seg, data in zip(segs, self._segments(segs)):
            parts.append(data[max(a, seg.start) - seg.start: min(b, seg.end) - seg.start])
            if seg not in self._read:  # its first read in this process: recently used (the file's mtime)
                self._read.add(seg)
                with contextlib.suppress(OSError):
                    os.utime(self._file(seg.path, seg.start, seg.end))
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def mapped(self, seg: Segment, holder: tuple[list, int]) -> np.ndarray | None:
        """The segment's bytes when this process has it mapped and has read it (its first read
        goes through read(), which records the use); holder[0][holder[1]] is set to None when
        the segment is unmapped (BlockArray keeps its ids there)."""
        with self._mu:
            data = self._maps.get(seg)
            if data is None or seg not in self._read:
                return None
            self._holders.setdefault(seg, []).append(holder)
            return data

    def _segments(self, segs: list[Segment]) -> list[np.ndarray]:
        got: dict[Segment, np.ndarray] = {}
        with self._mu:
            for seg in segs:
                if seg in self._maps:
                    self._maps.move_to_end(seg)
                    got[seg] = self._maps[seg]
            waits = {f for f in self._inflight.values()} if len(got) < len(segs) else set()
        for f in waits:  # a prefetch may be fetching them now: its GET, not a second one
            f.result()
        if waits:
            with self._mu:
                got.update((seg, self._maps[seg]) for seg in segs if seg in self._maps)
        missing = [s for s in segs if s not in got]
        if missing:
            got.update(self._ensure(missing))
        return [got[s] for s in segs]

    def prefetch(self, blocks) -> None:
        """Fetch and check these blocks' missing segments, and their tails, in background threads
        (what a sampler knows comes next): one GET a block."""
        with self._mu:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PREFETCH_THREADS, thread_name_prefix="helixtok-prefetch")
            for b in blocks:
                segs = list(b.segments) + ([b.tail] if b.tail is not None else [])
                if b not in self._inflight and not all(s in self._maps for s in segs):
                    fut = self._pool.submit(self._ensure, segs)
                    self._inflight[b] = fut
                    fut.add_done_callback(lambda _f, b=b: self._done(b))

    def _done(self, b: Block) -> None:
        with self._mu:
            self._inflight.pop(b, None)

    def _ensure(self, segs: list[Segment]) -> dict[Segment, np.ndarray]:
        """These segments on this node's disk, checked and mapped: cached ones read, the others
        fetched (one GET per run of consecutive missing ones) by this process or the one holding
        their lock; then kept mapped (within open_bytes)."""
        out, missing = {}, []
        for seg in segs:
            data = self._cached(seg)
            if data is None:
                missing.append(seg)
            else:
                out[seg] = data
        runs: list[list[Segment]] = []
        for seg in missing:
            if runs and runs[-1][-1].end == seg.start:
                runs[-1].append(seg)
            else:
                runs.append([seg])
        for run in runs:
            out.update(self._fetch_run(run))
        if runs:
            self._evict()
        with self._mu:
            for seg, data in out.items():
                if seg not in self._maps:
                    self._maps[seg] = data
                    self._mapped += len(data)
                self._maps.move_to_end(seg)
            while self._mapped > self.open_bytes and len(self._maps) > len(out):
                gone, old = self._maps.popitem(last=False)
                self._mapped -= len(old)
                for lst, k in self._holders.pop(gone, ()):
                    lst[k] = None
        return out

    def _cached(self, seg: Segment) -> np.ndarray | None:
        """The segment from the cache when it is there and intact (a damaged one is deleted)."""
        path = self._file(seg.path, seg.start, seg.end)
        data = self._map(path)
        if data is None:  # not there, or evicted by another reader of this cache since it looked
            return None
        if len(data) == seg.end - seg.start and hashlib.sha256(data).hexdigest() == seg.sha256:
            self._count("hits")
            return data
        self._count("refetched_damaged")
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None

    def _fetch_run(self, run: list[Segment]) -> dict[Segment, np.ndarray]:
        """Consecutive segments fetched with one range GET, under each one's lock (taken in shard
        order: no two fetchers wait on each other): another thread or process of this node
        fetching any of them is waited for, and its files are then read."""
        with contextlib.ExitStack() as locks:
            for seg in run:
                locks.enter_context(self._flock(os.path.basename(self._file(seg.path, seg.start, seg.end))))
            have = {s: d for s in run if (d := self._cached(s)) is not None}
            need = [s for s in run if s not in have]
            if need:
                lo, hi = need[0].start, need[-1].end
                raw = memoryview(self._get(run[0].path, lo, hi))
                for s in need:
                    piece = raw[s.start - lo: s.end - lo]
                    if len(piece) != s.end - s.start or hashlib.sha256(piece).hexdigest() != s.sha256:
                        raise DatasetError(f"{redact(self._url(s.path))}: bytes {s.start}-{s.end} do not hash to "
                                           "the segment its manifest records (the object changed or is damaged); "
                                           "push the dataset again")
                    path = self._file(s.path, s.start, s.end)
                    self._place(path, piece)
                    mapped = self._map(path)  # (evicted at once by another reader: the bytes in hand)
                    have[s] = mapped if mapped is not None else np.frombuffer(bytes(piece), np.uint8)
                    self._count("misses")
        return have

    @staticmethod
    def _map(path: str) -> np.ndarray | None:
        """The cached file mapped (its size then checked by the caller against the manifest's), or
        None when it is not there."""
        try:
            fh = open(path, "rb")
        except FileNotFoundError:
            return None
        with fh:
            size = os.fstat(fh.fileno()).st_size
            return np.memmap(fh, dtype=np.uint8, mode="r", shape=(size,)).view(np.ndarray) if size else \
                np.empty(0, np.uint8)

    def _get(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        url = self._url(rel)
        with storage_errors(self.root):  # a driver's own error (connection refused) as one line
            try:
                data = self.fs.cat_file(url, start=start, end=end)
            except FileNotFoundError:
                raise DatasetError(f"{redact(url)}: missing; the dataset in object storage is incomplete (push it "
                                   "again)") from None
        self._count("gets")
        self._count("bytes_fetched", len(data))
        return data

    def _place(self, path: str, data) -> None:
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)
        except OSError as e:  # a full or read-only cache disk: the reader's own folder, named with the fix
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise DatasetError(f"{self.cache_dir}: cannot cache {os.path.basename(path)} there ({e.strerror or e}); "
                               "free space on that disk or give a smaller cache_limit (or another cache_dir)") from e

    @contextlib.contextmanager
    def _flock(self, name: str):
        os.makedirs(os.path.join(self.dir, ".locks"), exist_ok=True)  # (a cache folder emptied meanwhile)
        with open(os.path.join(self.dir, ".locks", name), "a+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _count(self, k: str, n: int = 1) -> None:
        with self._mu:
            self.counts[k] += n

    def _evict(self) -> None:
        """Above the limit, the least recently used files of every dataset in cache_dir go."""
        if self.limit is None:
            return
        with self._flock_root():
            files = []
            for d in os.scandir(self.cache_dir):
                if not d.is_dir():
                    continue
                for f in os.scandir(d.path):
                    if f.is_file() and not f.name.endswith(".tmp"):
                        st = f.stat()
                        files.append((st.st_mtime_ns, st.st_size, f.path))
            total = sum(s for _, s, _ in files)
            for _, size, p in sorted(files):
                if total <= self.limit:
                    break
                with contextlib.suppress(OSError):
                    os.unlink(p)
                    total -= size

    @contextlib.contextmanager
    def _flock_root(self):
        with open(os.path.join(self.cache_dir, ".evict.lock"), "a+b") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ small files

    def whole(self, rel: str, sha256: str | None, size: int) -> bytes:
        """A small file of the dataset (sidecar, index, tokenizer), cached whole and checked by its sha256."""
        path = self._file(rel)

        def intact(data: bytes) -> bool:
            return len(data) == size and (sha256 is None or hashlib.sha256(data).hexdigest() == sha256)

        def cached() -> bytes | None:
            try:
                with open(path, "rb") as fh:
                    data = fh.read()
            except FileNotFoundError:
                return None
            if intact(data):
                return data
            self._count("refetched_damaged")
            return None

        data = cached()
        if data is None:
            with self._flock(os.path.basename(path)):
                data = cached()  # another process may have fetched it while this one waited
                if data is None:
                    data = self._get(rel)
                    if not intact(data):
                        raise DatasetError(f"{redact(self._url(rel))}: not the file its manifest records (size or "
                                           "sha256 differs); push the dataset again")
                    self._place(path, data)
                    self._count("misses")
                    return data
        self._count("hits")
        return data


class BlockArray:
    """One shard's ids in object storage, read as an array: a slice reads (fetching what the cache
    lacks) the segments it covers, an int one id; what MemmapChunkDataset reads where a local shard
    is mapped."""

    def __init__(self, cache: BlockCache, blocks: list[Block], n: int, dtype):
        self.cache, self.n, self.dtype = cache, n, np.dtype(dtype)
        self.item = self.dtype.itemsize
        self.segments = [s for b in blocks for s in b.segments]
        self._seg_starts = [s.start for s in self.segments]
        # Per segment, in ids: where it starts and ends, and its ids once this process has read it
        # (the cache sets the entry back to None when it unmaps the segment).
        self._id_starts = [s.start // self.item for s in self.segments]
        self._id_ends = [s.end // self.item for s in self.segments]
        self._ids: list[np.ndarray | None] = [None] * len(self.segments)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key):
        if type(key) is slice and key.step is None and type(key.start) is int and type(key.stop) is int \
                and 0 <= key.start <= key.stop <= self.n:
            a, b = key.start, key.stop  # what the dataset asks: checked ints, no slice.indices() call
        elif isinstance(key, slice):
            a, b, step = key.indices(self.n)
            if step != 1:
                raise IndexError("a BlockArray is sliced with step 1")
        else:
            a = int(key) + (self.n if int(key) < 0 else 0)
            if not 0 <= a < self.n:
                raise IndexError(f"id {key} outside a shard of {self.n}")
            return self[a: a + 1][0]
        if b <= a:
            return np.empty(0, self.dtype)
        i = bisect.bisect_right(self._id_starts, a) - 1
        ids = self._ids[i]
        if ids is not None and b <= self._id_ends[i]:  # the common case: one segment read before here
            t0 = self._id_starts[i]
            return ids[a - t0: b - t0]
        item = self.item
        lo, hi = a * item, b * item
        j = bisect.bisect_left(self._seg_starts, hi)
        out = self.cache.read(self.segments[i:j], lo, hi).view(self.dtype)
        for k in range(i, j):
            if self._ids[k] is None:
                data = self.cache.mapped(self.segments[k], (self._ids, k))
                if data is not None:
                    self._ids[k] = data.view(self.dtype)
        return out


def parse_limit(limit) -> int | None:
    """cache_limit as bytes: an int, or a size like "200GB" / "64MiB"; None: no limit."""
    return None if limit is None else parse_bytes(limit)
