"""Compressed JSON lines: zstd frames read so that damage is an error, and one large .gz or .zst
file planned as ranges that several workers read."""

from __future__ import annotations

import bisect
import contextlib
import gzip
import hashlib
import io
import json
import os
import threading
import zlib
from typing import Iterator

from ..format.errors import ConfigError, InputError
from ..format.manifest import write_json_atomic
from ..format.objstore import is_url, open_input, size_of
from .inputfile import InputFile

GZ_INDEX_SPACING = 4 << 20  # decompressed bytes between seek points: what a worker decompresses to skip
# zstd cannot resume inside a frame: a range decompresses its frame from the start and discards the
# bytes before it, (n - 1) / 2 frames of extra decompression for n ranges.  zstd decompresses ~1 GB/s
# and fastokens tokenizes ~0.13 GB/s per core, so 8 ranges cost ~45% more CPU, and the frame no
# longer waits for one worker (measured in docs/performance.md).  A file of many frames (pzstd, or
# .zst files concatenated) is cut at frame boundaries at least a range apart: no discarding.
ZST_RANGES_PER_FRAME = 8
ZST_GROUP_FRAMES = 4  # frames of undeclared size from which a .zst is cut between frames (no pass)


# Builds a .gz file's seek index in a process of its own: indexed_gzip holds the GIL while it
# indexes, and the line-cut pass (zlib, which checks every member's CRC) runs meanwhile.
# It dies with the build (start_helper): an orphan would index on, and leave its file behind.
_GZ_INDEXER = """
import sys
import indexed_gzip
path, out, spacing = sys.argv[1], sys.argv[2], int(sys.argv[3])
try:
    with open(path, "rb") as raw:
        gz = indexed_gzip.IndexedGzipFile(fileobj=raw, spacing=spacing, readbuf_size=1 << 20)
        gz.build_full_index()
except Exception as e:
    sys.exit(f"data:{e}")
try:
    gz.export_index(out)
except OSError as e:
    sys.exit(f"write:{e.strerror or e}")
"""


def plan_gzip(f: InputFile, unit_bytes: int, halt: threading.Event, stall: float = 600.0
              ) -> tuple[str, list[tuple[int, int, int, int, int]]]:
    """Line-aligned ranges of a large .gz file's decompressed bytes, and a seek index (cached by
    name, size and stamp) that lets each worker start at its range.

    The ranges come from Python's gzip, which checks every member's CRC and length: indexed_gzip
    alone returns a stream cut short, without an error, for a file truncated mid-deflate.  The
    index of a local file is built meanwhile in another process (planning a 642 MB file: 4.3 s
    one pass after the other).
    """
    import subprocess

    from .children import communicate_while_alive, start_helper
    from .config import cache_root

    identity = [f.path, f.size, f.stamp, GZ_INDEX_SPACING]
    key = hashlib.sha256("|".join(map(str, identity)).encode()).hexdigest()
    index = os.path.join(cache_root(), "gzindex", key + ".idx")
    tmp = f"{index}.{os.getpid()}.tmp"
    indexer = None
    if not index_intact(index, identity):
        drop_index(index)
    if not os.path.isfile(index) and not is_url(f.path):
        _cache_dir_for(index, f.path)
        with contextlib.suppress(OSError):  # no interpreter to start (embedded Python): index here, after
            indexer = start_helper(_GZ_INDEXER, f.path, tmp, str(GZ_INDEX_SPACING),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        try:
            with open_input(f.path) as raw:
                cuts = list(line_cuts(gzip.GzipFile(fileobj=raw), unit_bytes, halt=halt))
        except (EOFError, OSError, zlib.error) as e:
            raise damaged(f.path, f.kind, e, "truncated or corrupt") from e
        if halt.is_set():
            return "", cuts
        if indexer is not None:
            why = communicate_while_alive(indexer, stall, f"indexing {f.path}")[1]
            why = why.decode(errors="replace").strip().splitlines()
            if indexer.returncode:
                kind, _, msg = (why[-1] if why else "data:exit status %d" % indexer.returncode).partition(":")
                if kind == "write":
                    raise _unwritable(index, f.path, msg)
                raise damaged(f.path, f.kind, ValueError(msg), "truncated or corrupt")
            os.replace(tmp, index)
            _seal_index(index, identity)
        elif not os.path.isfile(index):
            _index_here(f, index, tmp)
            _seal_index(index, identity)
        return index, cuts
    finally:
        if indexer is not None and indexer.poll() is None:
            indexer.kill()
            indexer.wait()
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _index_here(f: InputFile, index: str, tmp: str) -> None:
    """The seek index built in this process: for a URL (the indexer process reads local files
    only), or where no interpreter could be started for it."""
    import indexed_gzip

    try:
        with open_input(f.path) as raw:
            gz = indexed_gzip.IndexedGzipFile(fileobj=raw, spacing=GZ_INDEX_SPACING, readbuf_size=1 << 20)
            gz.build_full_index()
    except (EOFError, OSError, zlib.error, indexed_gzip.ZranError) as e:
        raise damaged(f.path, f.kind, e, "truncated or corrupt") from e
    _cache_dir_for(index, f.path)
    try:
        gz.export_index(tmp)
        os.replace(tmp, index)
    except OSError as e:
        raise _unwritable(index, f.path, e.strerror or str(e)) from e


def _index_meta(index: str) -> str:
    return index[: -len(".idx")] + ".json"


def _index_sha256(index: str) -> str:
    h = hashlib.sha256()
    with open(index, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _seal_index(index: str, identity: list) -> None:
    """Record the index's sha256 and the exact file it indexes beside it (written after the index:
    an index without its record is never trusted)."""
    try:
        write_json_atomic(_index_meta(index), {"sha256": _index_sha256(index), "file": identity}, durable=False)
    except OSError as e:
        raise _unwritable(index, identity[0], e.strerror or str(e)) from e


def index_intact(index: str, identity: list) -> bool:
    """Whether a cached seek index is whole and is the index of this very file (name, size, stamp)."""
    try:
        with open(_index_meta(index)) as fh:
            meta = json.load(fh)
        return isinstance(meta, dict) and meta.get("file") == identity and meta.get("sha256") == _index_sha256(index)
    except (OSError, ValueError):
        return False


def drop_index(index: str) -> None:
    """Remove a cache entry found damaged (or not matching what it was read for): built again when next needed."""
    for p in (index, _index_meta(index)):
        with contextlib.suppress(OSError):
            os.remove(p)


def _cache_dir_for(index: str, path: str) -> None:
    try:
        os.makedirs(os.path.dirname(index), exist_ok=True)
    except OSError as e:
        raise _unwritable(index, path, e.strerror or str(e)) from e


def _unwritable(index: str, path: str, why: str) -> ConfigError:
    # A cache that cannot be written is a setup problem, not a damaged input.
    return ConfigError(f"cannot write the seek index for {path} to {index} ({why}); set "
                       "HELIXTOK_CACHE to a writable folder")


def line_cuts(fh, unit_bytes: int, halt: threading.Event | None = None) -> Iterator[tuple[int, int, int, int, int]]:
    """(start, stop, first line, lines, crc32) of line-aligned ranges of fh's bytes, each at least
    unit_bytes: the last two let a reader of a range prove it read exactly those bytes.
    Ends early, with a plan nobody uses, once `halt` is set (the planner failed or was stopped)."""
    start, line, pos, lines_before, crc, open_line = 0, 1, 0, 0, 0, False
    while True:
        block = fh.read(8 << 20)
        if not block or (halt is not None and halt.is_set()):
            break
        view, i = memoryview(block), 0
        while True:
            target = start + unit_bytes - pos  # index in block where this unit is full
            nl = block.find(b"\n", max(target, i)) if target < len(block) else -1
            if nl < 0:
                lines_before += block.count(b"\n", i)
                crc = zlib.crc32(view[i:], crc)
                break
            lines_before += block.count(b"\n", i, nl + 1)
            crc = zlib.crc32(view[i: nl + 1], crc)
            stop = pos + nl + 1
            yield start, stop, line, lines_before + 1 - line, crc
            start, line, i, crc = stop, lines_before + 1, nl + 1, 0
        open_line = not block.endswith(b"\n")
        pos += len(block)
    if pos > start:
        yield start, pos, line, lines_before + 1 - line + open_line, crc


def plan_zstd(f: InputFile, range_bytes: int, share: int, halt: threading.Event) -> list[dict]:
    """The ranges (Unit fields) of a large .zst file, planned without decompressing it where possible.

    Every frame declares its size (zstd writes it for a file it compresses): the sizes come from
    a walk over the frame and block headers, and the file is cut by decompressed offset
    (_zstd_ranges).  At least ZST_GROUP_FRAMES frames of undeclared size (pzstd's output,
    concatenated streams): cut between frames, by compressed offset (_zstd_frame_groups).
    Fewer frames without sizes: decompressed once to measure them, then cut by offset.  Either
    way a file that ends inside a frame is refused here.  `share`: how many ranges the file's
    part of the corpus calls for; a frame is cut into at most ZST_RANGES_PER_FRAME.
    """
    try:
        walked = _zstd_walk(f.path)
        if all(size is not None for _, size in walked):
            frames, produced = [], 0
            for c, size in walked:
                if size:
                    frames.append((c, produced, size))
                produced += size
        elif len(walked) >= ZST_GROUP_FRAMES:
            return [dict(start=a, stop=b, first_line=0, est_bytes=(b - a) * 4, seek=(a, 0), frames=True)
                    for a, b in _zstd_frame_groups(walked, f.size, range_bytes)]
        else:
            with open_input(f.path) as raw:
                z = ZstdRaw(raw)
                while z.read(8 << 20) and not halt.is_set():
                    pass
            ends = [d for _, d in z.frames[1:]] + [z.produced]
            frames = [(c, d, e - d) for (c, d), e in zip(z.frames, ends) if e > d]
    except (EOFError, OSError) as e:
        raise damaged(f.path, f.kind, e, "truncated or corrupt") from e
    ranges = _zstd_ranges(frames, range_bytes, min(ZST_RANGES_PER_FRAME, share))
    return [dict(start=a, stop=b, first_line=0, est_bytes=b - a, seek=seek, ends_file=i == len(ranges) - 1)
            for i, (a, b, seek) in enumerate(ranges)]


def _zstd_walk(path: str) -> list[tuple[int, int | None]]:
    """(compressed offset, declared decompressed size or None) of each data frame of a .zst file,
    from the frame and block headers alone.  Raises EOFError where the file ends inside a frame."""
    import zstandard

    frames = []
    with open_input(path) as fh:
        size = size_of(fh)
        at = 0
        while at < size:
            fh.seek(at)
            head = fh.read(18)  # the longest frame header
            magic = int.from_bytes(head[:4], "little")
            if len(head) >= 8 and magic & 0xFFFFFFF0 == 0x184D2A50:  # a skippable frame: no data
                at += 8 + int.from_bytes(head[4:8], "little")
                continue
            try:
                params = zstandard.get_frame_parameters(head)
                at_blocks = at + zstandard.frame_header_size(head)
            except zstandard.ZstdError as e:
                if len(head) < 18 and magic == 0xFD2FB528:
                    raise EOFError("zstd stream ends inside a frame header") from e
                raise OSError(f"corrupt zstd data: {e}") from e
            pos = at_blocks
            while True:  # 3-byte block headers: last-block bit, type, size
                fh.seek(pos)
                bh = fh.read(3)
                if len(bh) < 3:
                    raise EOFError("zstd stream ends inside a frame")
                h = int.from_bytes(bh, "little")
                kind, n = (h >> 1) & 3, h >> 3
                pos += 3 + (1 if kind == 1 else n)  # an RLE block stores one byte
                if h & 1:
                    break
            pos += 4 if params.has_checksum else 0
            if pos > size:
                raise EOFError("zstd stream ends inside a frame")
            known = params.content_size != zstandard.CONTENTSIZE_UNKNOWN
            frames.append((at, params.content_size if known else None))
            at = pos
    return frames


def _zstd_frame_groups(walked: list[tuple[int, int | None]], size: int, range_bytes: int) -> list[tuple[int, int]]:
    """(start, stop) compressed offsets of runs of whole frames, each about range_bytes of text
    (estimated at 4x its compressed size); the first starts at the file's start.

    A run owns the lines that begin from the second byte of its first frame up to the first
    byte of the next run's first frame (the first run: from the start): the same rule as a cut
    by offset one byte into a frame, with the offset learnt by the reader as it decompresses."""
    groups, a = [], 0
    for c, _ in walked[1:]:
        if (c - a) * 4 >= range_bytes:
            groups.append((a, c))
            a = c
    return groups + [(a, size)]


def _zstd_ranges(frames: list[tuple[int, int, int]], range_bytes: int, per_frame: int
                 ) -> list[tuple[int, int, tuple[int, int]]]:
    """(start, stop, seek point) of decompressed byte ranges covering a .zst file's frames.

    Cut by offset, not at line ends, so no pass over the data is needed: a range owns the lines
    that begin inside it, and its reader finds the first of them from the byte before `start`.
    That byte must lie in the frame the reader starts from (zstd cannot resume inside a frame,
    so each range reads its frame from the beginning and discards up to there): a cut at a frame
    boundary goes one byte into the frame.  Ranges are at least range_bytes; a frame is cut into
    at most `per_frame`.
    """
    cuts = [0]
    for _, d, size in frames:
        if d > 0 and d + 1 - cuts[-1] >= range_bytes:
            cuts.append(d + 1)
        pieces = min(per_frame, max(1, size // range_bytes))
        cuts += [d + j * size // pieces for j in range(1, pieces) if d + j * size // pieces > cuts[-1]]
    total = frames[-1][1] + frames[-1][2] if frames else 0
    cuts = [c for c in cuts if c < total] + [total]

    starts = [d for _, d, _ in frames]

    def seek(a: int) -> tuple[int, int]:  # the frame holding byte a - 1
        return frames[bisect.bisect_right(starts, a - 1) - 1][:2] if a else (0, 0)

    return [(a, b, seek(a)) for a, b in zip(cuts, cuts[1:])]


class ZstdRaw(io.RawIOBase):
    """Decompress zstd frame after frame; a file that ends inside a frame raises EOFError.

    (zstandard's stream_reader returns a clean EOF on a truncated frame: silent data loss.)
    `frames` lists (compressed offset, decompressed offset) of each frame begun so far; `offset`
    is where in the file `raw` is positioned (the start of a frame).
    """

    def __init__(self, raw, offset: int = 0):
        import zstandard

        self._zstd = zstandard
        self._raw = raw
        self._d = zstandard.ZstdDecompressor().decompressobj()
        self._buf = memoryview(b"")
        self._started = False
        self._fed = offset  # compressed bytes read, as a file offset
        self.produced = 0  # decompressed bytes made
        self.frames: list[tuple[int, int]] = []

    def readable(self) -> bool:
        return True

    def _fill(self) -> bool:
        """Decompress the next block of input; False at the end of the stream."""
        data = self._raw.read(1 << 20)
        if not data:
            if self._started:
                raise EOFError("zstd stream ends inside a frame")
            return False
        at, self._fed = self._fed, self._fed + len(data)
        out = []
        while data:
            if not self._started:
                self.frames.append((at, self.produced))
                self._started = True
            try:
                out.append(self._d.decompress(data))
            except self._zstd.ZstdError as e:
                raise OSError(f"corrupt zstd data: {e}") from e
            self.produced += len(out[-1])
            if self._d.eof:  # a new frame may follow (concatenated .zst files are valid)
                data = self._d.unused_data
                at = self._fed - len(data)
                self._d = self._zstd.ZstdDecompressor().decompressobj()
                self._started = False
            else:
                data = b""
        self._buf = memoryview(b"".join(out))
        return True

    def read(self, size: int = -1) -> bytes:
        """Up to `size` bytes; with a large size, one decompressed block as made (no extra copy)."""
        if size is None or size < 0:
            return self.readall()
        while not self._buf:
            if not self._fill():
                return b""
        if size < len(self._buf):
            out, self._buf = self._buf[:size].tobytes(), self._buf[size:]
            return out
        out = self._buf.obj if len(self._buf) == len(self._buf.obj) else self._buf.tobytes()
        self._buf = memoryview(b"")
        return out

    def readinto(self, b) -> int:
        while not self._buf:
            if not self._fill():
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def skip(self, n: int) -> None:
        """Decompress and discard n bytes (to reach a range inside a frame)."""
        while n > 0:
            if not self._buf and not self._fill():
                raise EOFError(f"zstd stream ends {n} bytes before the range")
            k = min(n, len(self._buf))
            self._buf = self._buf[k:]
            n -= k


def open_stream(path: str, kind: str, raw: io.BufferedReader):
    if kind == "jsonl.gz":
        return io.BufferedReader(gzip.GzipFile(fileobj=raw), 1 << 20)
    if kind == "jsonl.zst":
        return io.BufferedReader(ZstdRaw(raw), 1 << 20)
    return raw


def _complete_lines(path: str, kind: str) -> int:
    """Newlines readable before a compressed stream breaks (slow path, for the error message only):
    the buffered reader fails on the block holding the damage, before the lines ahead of it."""
    n = 0
    with open_input(path) as raw:
        stream = gzip.GzipFile(fileobj=raw) if kind == "jsonl.gz" else ZstdRaw(raw) if kind == "jsonl.zst" else raw
        try:
            # read1: one decompression step at a time, so no block is lost when the next one fails
            while block := getattr(stream, "read1", stream.read)(1 << 16):
                n += block.count(b"\n")
        except Exception:  # noqa: BLE001 - the damage we are locating
            pass
    return n


def damaged(path: str, kind: str, e: BaseException, what: str) -> InputError:
    return InputError(f"{path}: {what} after line {_complete_lines(path, kind)}, its last complete line ({e}); "
                      "re-create the file or leave it out")
