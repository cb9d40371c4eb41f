"""Find corpus files, cut them into work units, and read documents out of a unit."""

from __future__ import annotations

import dataclasses
import glob
import io
import json
import os
import posixpath
import re
import stat
import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Iterator

try:
    import orjson
except ImportError:  # optional speed-up: the stdlib path reads every line the same way
    orjson = None

from .compressed import ZstdRaw, damaged, drop_index, open_stream, plan_gzip, plan_zstd
from .errors import InputError
from .inputfile import InputFile
from .longdoc import (
    LONG_DOC_BYTES,
    SURROGATE,
    LongText,
    long_text_file,
    parse_long_line,
    repair_surrogates,
    skeleton,
)
from .objstore import (
    expired,
    filesystem,
    is_url,
    local_stamp,
    open_input,
    redact,
    reports_storage_errors,
    size_of,
    stamp,
)

SUFFIXES = {
    ".txt": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".jsonl.gz": "jsonl.gz",
    ".jsonl.zst": "jsonl.zst",
    ".jsonl.zstd": "jsonl.zst",
    ".parquet": "parquet",
    ".arrow": "arrow",  # Arrow IPC (stream or file): HF datasets' save_to_disk folders and cache
}
# Metadata that HF datasets writes beside its .arrow files: part of the dataset, not text.
HF_DATASETS_METADATA = {"state.json", "dataset_info.json", "dataset_dict.json"}


def _hf_metadata(path: str) -> bool:
    """Files HF datasets keeps beside its Arrow data (info, state, and its cache's .lock files)."""
    name = posixpath.basename(path)
    return name in HF_DATASETS_METADATA or name.endswith(".lock")
SUPPORTED = ", ".join(SUFFIXES)
MAX_EXAMPLES = 5  # locations kept per skip reason, for the summary and the manifest
_GLOB_CHARS = set("*?[")


def file_kind(path: str) -> str | None:
    low = path.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if low.endswith(suffix):
            return SUFFIXES[suffix]
    return None


@dataclass
class Tally:
    """Counts of what was skipped or repaired, with the first few locations of each."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    strict: bool = False  # --strict: the first problem is an error, where it is found
    first: str | None = None  # the first problem met, in reading order: what --strict reports

    def add(self, reason: str, where: str, n: int = 1) -> None:
        if self.strict:
            raise InputError(f"{where}: {reason.replace('_', ' ')} (--strict)")
        if self.first is None:
            self.first = f"{where}: {reason.replace('_', ' ')}"
        self.counts[reason] = self.counts.get(reason, 0) + n
        ex = self.examples.setdefault(reason, [])
        if len(ex) < MAX_EXAMPLES:
            ex.append(where)

    def merge(self, other: "Tally") -> None:
        self.first = self.first or other.first
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
            ex = self.examples.setdefault(reason, [])
            ex.extend(other.examples.get(reason, [])[: MAX_EXAMPLES - len(ex)])

    def to_json(self) -> dict:
        return {r: {"count": self.counts[r], "examples": self.examples.get(r, [])} for r in sorted(self.counts)}

    @classmethod
    def from_json(cls, d: dict) -> "Tally":
        t = cls()
        for r, v in d.items():
            t.counts[r] = v["count"]
            t.examples[r] = list(v["examples"])
        return t


# --------------------------------------------------------------------------- discovery


_NOT_REGULAR = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
                stat.S_IFSOCK: "a socket"}


def discover(paths: list[str], *, exclude: str | None = None) -> tuple[list[InputFile], Tally]:
    """Expand files, directories (recursively, following links) and globs into a sorted file list.

    A path or pattern that names nothing is an error; unsupported files and ones that are not
    regular files (FIFOs, devices, sockets) met inside a directory are left out and counted
    (named explicitly, they are an error).  Every folder is read once (by device and inode), a
    directory link that leads outside the folders given is not followed, and a file reached
    twice (hard or symbolic link) is read once.
    """
    urls = [p for p in paths if is_url(p)]
    if urls:
        if len(urls) != len(paths):
            raise InputError(f"{urls[0]}: local paths and URLs in one build; build each separately "
                             "(docs/scale.md shows how to merge builds)")
        return _discover_urls(urls)
    warnings = Tally()
    found: dict[tuple[int, int], str] = {}  # (dev, inode) -> path as found
    visited: set[tuple[int, int]] = set()
    skip_real = os.path.realpath(exclude) if exclude else None
    roots: list[str] = []

    def inside(real: str, top: str) -> bool:
        return real == top or real.startswith(top.rstrip(os.sep) + os.sep)

    def add_file(p: str, st: os.stat_result, explicit: bool) -> None:
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the build, a device never end
            what = _NOT_REGULAR.get(stat.S_IFMT(st.st_mode), "a special file")
            if explicit:
                raise InputError(f"{p}: {what}, not a regular file; name the corpus files themselves")
            warnings.add("not_a_regular_file", f"{os.path.abspath(p)} ({what})")
            return
        kind = file_kind(p)
        if kind is None and not explicit and _hf_metadata(p):
            return
        if kind is None:
            if explicit:
                hint = ""
                if p.lower().endswith((".json", ".json.gz")):
                    hint = (" If it holds JSON Lines, rename it to .jsonl; if it is one JSON array,"
                            f" convert it with: jq -c '.[]' {p} > {p}l")
                raise InputError(f"{p}: unsupported file type; supported: {SUPPORTED}.{hint}")
            warnings.add("unsupported_file", os.path.abspath(p))
            return
        key = (st.st_dev, st.st_ino)
        if key in found:
            warnings.add("duplicate_file", f"{os.path.abspath(p)} (same file as {os.path.abspath(found[key])})")
            return
        found[key] = p

    def walk(d: str) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except PermissionError as e:
            raise InputError(f"{d}: cannot list directory ({e.strerror}); fix its permissions or leave it out") from e
        for e in entries:
            p = os.path.join(d, e.name)
            real = os.path.realpath(p)
            if skip_real and inside(real, skip_real):
                continue
            try:
                st = os.stat(p)
            except FileNotFoundError as err:
                raise InputError(f"{p}: broken symbolic link; fix it or remove it") from err
            except OSError as err:
                if err.errno == 40:  # ELOOP: a link that points at itself
                    warnings.add("symlink_loop", os.path.abspath(p))
                    continue
                raise InputError(f"{p}: cannot stat ({err.strerror})") from err
            if stat.S_ISDIR(st.st_mode):
                if e.is_symlink() and not any(inside(real, r) for r in roots):
                    warnings.add("link_outside_corpus", os.path.abspath(p))
                    continue
                enter_dir(p, st)
            else:
                add_file(p, st, explicit=False)

    def enter_dir(p: str, st: os.stat_result) -> None:
        key = (st.st_dev, st.st_ino)
        if key in visited:  # a link loop, or a second way into a folder already read
            warnings.add("symlink_loop", os.path.abspath(p))
            return
        visited.add(key)
        walk(p)

    def check_not_in_out(arg: str) -> None:
        if skip_real and inside(os.path.realpath(arg), skip_real):
            raise InputError(f"{arg}: is inside the output folder {exclude}; move the corpus out of it "
                             "or choose another output folder")

    for arg in paths:
        if os.path.isdir(arg):
            check_not_in_out(arg)
            roots.append(os.path.realpath(arg))
        elif not os.path.exists(arg) and _GLOB_CHARS & set(arg):
            roots.extend(os.path.realpath(m) for m in glob.glob(arg, recursive=True) if os.path.isdir(m))
    for arg in paths:
        if os.path.isdir(arg):
            enter_dir(arg, os.stat(arg))
        elif os.path.exists(arg):
            check_not_in_out(arg)
            add_file(arg, os.stat(arg), explicit=True)
        elif os.path.lexists(arg):
            raise InputError(f"{arg}: broken symbolic link; fix it or remove it")
        elif _GLOB_CHARS & set(arg):
            matches = sorted(glob.glob(arg, recursive=True))
            if not matches:
                raise InputError(f"{arg}: pattern matched no files")
            for m in matches:
                if skip_real and inside(os.path.realpath(m), skip_real):
                    continue
                if os.path.isdir(m):
                    enter_dir(m, os.stat(m))
                else:
                    add_file(m, os.stat(m), explicit=False)
        else:
            raise InputError(f"{arg}: no such file or directory")

    if not found:
        raise InputError(f"no corpus files found in {' '.join(paths)} (supported: {SUPPORTED})")
    ordered = sorted(found.values())
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in ordered])
    files = []
    for p in ordered:
        if not os.access(p, os.R_OK):
            raise InputError(f"{p}: permission denied; make it readable or leave it out")
        st = os.stat(p)
        files.append(InputFile(p, os.path.relpath(os.path.abspath(p), root), file_kind(p), st.st_size,
                               local_stamp(st)))
    # The manifest keeps warning locations relative to the corpus root, never host paths.
    top = os.path.commonpath([root] + [os.path.abspath(a) for a in paths if os.path.isdir(a)])
    prefix = top.rstrip(os.sep) + os.sep
    for reason, ex in warnings.examples.items():
        warnings.examples[reason] = [x.replace(prefix, "") for x in ex]
    return files, warnings


@reports_storage_errors
def _discover_urls(urls: list[str]) -> tuple[list[InputFile], Tally]:
    """discover() for object storage: prefixes (every object below), globs and single objects.

    Names are relative to the common prefix of the objects found, as local names are to the
    common folder; an object's stamp is its ETag (or the like), checked again before publishing.
    """
    warnings = Tally()
    found: dict[str, dict] = {}  # fs path -> info
    fs = None
    for url in urls:
        fs_u, path = filesystem(url)
        fs_u.invalidate_cache()  # listings are cached per process: a rerun must see objects as they are now
        if fs is None:
            fs = fs_u
        elif type(fs_u) is not type(fs):
            raise InputError(f"{redact(url)}: inputs on two kinds of storage; build each separately")
        try:
            if _GLOB_CHARS & set(path):
                matches = fs.glob(path, detail=True)
                if not matches:
                    raise InputError(f"{redact(url)}: pattern matched no objects")
                entries = {}
                for p, info in matches.items():
                    entries.update(fs.find(p, detail=True) if info.get("type") == "directory" else {p: info})
                explicit = False
            elif fs.isdir(path):
                entries, explicit = fs.find(path, detail=True), False
            else:
                entries, explicit = {path: fs.info(path)}, True
        except FileNotFoundError as e:
            raise InputError(f"{redact(url)}: no such object or prefix") from e
        except PermissionError as e:
            raise InputError(f"{redact(url)}: access denied ({e}); check the credentials in the environment") from e
        for p, info in sorted(entries.items()):
            if info.get("type") == "directory":
                continue
            kind = file_kind(p)
            if kind is None:
                if explicit:
                    raise InputError(f"{redact(url)}: unsupported file type; supported: {SUPPORTED}")
                if not _hf_metadata(p):
                    warnings.add("unsupported_file", p)
                continue
            found[p] = info
    if not found:
        raise InputError(f"no corpus files found in {' '.join(map(redact, urls))} (supported: {SUPPORTED})")
    ordered = sorted(found)
    root = posixpath.commonpath([posixpath.dirname(p) for p in ordered])
    files = [InputFile(redact(fs.unstrip_protocol(p)), posixpath.relpath(p, root), file_kind(p),
                       int(found[p].get("size") or 0), stamp(found[p])) for p in ordered]
    for reason, ex in warnings.examples.items():
        warnings.examples[reason] = [posixpath.relpath(x, root) if x.startswith(root) else x for x in ex]
    return files, warnings


# --------------------------------------------------------------------------- work units


@dataclass(frozen=True)
class Unit:
    """A piece of the corpus that one worker reads and tokenizes; a function of the input alone.

    text: files[] are whole documents.  jsonl: bytes [start, stop) of one file, cut at line
    ends; first_line 0 (its number is only known once the units before it are read: see
    LineRefs).  jsonl.gz: a large file is cut the same way in its decompressed bytes, a range
    starting at a point of its seek index (`aux`).  jsonl.zst: a large file's decompressed bytes
    cut anywhere, a range owning the lines that begin in it and read from the start of the frame
    holding the byte before it (`seek`); a file whose frames do not declare their sizes is cut
    between frames instead (`frames`: start/stop are compressed offsets, each range owning the
    lines that begin from the second byte of its first frame on).  stop == 0: the whole file.
    parquet: row groups
    [start, stop), first_line the index of its first row.
    """

    index: int
    kind: str
    files: tuple[str, ...]
    names: tuple[str, ...]
    start: int = 0
    stop: int = 0
    first_line: int = 1
    est_bytes: int = 0  # input text bytes, for scheduling and progress
    aux: str = ""  # jsonl.gz line ranges: the seek index file (a cache, not part of the plan)
    # jsonl.gz line ranges: (lines, crc32) of the range's bytes as planned; a reader proves it read
    # exactly them (a damaged cached index must never change the data).
    check: tuple[int, int] = (0, 0)
    seek: tuple[int, int] = (0, 0)  # jsonl.zst ranges: (compressed, decompressed) offset of a frame
    ends_file: bool = False  # jsonl.zst ranges: the last, which must end where the data ends
    frames: bool = False  # jsonl.zst: start/stop are compressed offsets of whole frames (sizes undeclared)

    @property
    def skip_bytes(self) -> int:
        """Decompressed bytes a reader discards before this unit (a .zst range inside a frame): up to
        the byte before `start`, from which it finds where the range's first line begins."""
        return max(0, self.start - 1 - self.seek[1]) if self.kind == "jsonl.zst" and self.stop and not self.frames else 0

    def to_json(self) -> dict:
        return {"kind": self.kind, "files": list(self.names), "start": self.start, "stop": self.stop}


def plan_units(files: list[InputFile], *, unit_bytes: int, text_field: str, stall: float = 600.0
               ) -> tuple[list[Unit], Tally]:
    units: list[Unit] = []
    warnings = Tally()
    # A compressed file is split into ranges when it is large in absolute terms and relative
    # to the corpus (a corpus of many such files is already parallel; splitting costs a pass over
    # each).  Both are functions of the input alone: the units do not depend on --workers.
    packed_total = sum(f.size for f in files if f.kind in ("jsonl.gz", "jsonl.zst"))
    split_at = max(SPLIT_BYTES, packed_total // SPLIT_SHARE)
    range_bytes = max(unit_bytes, RANGE_MIN_BYTES)
    big = [f for f in files if f.kind in ("jsonl.gz", "jsonl.zst") and f.size >= split_at]
    for f in big:  # a wrong --text-field fails before any long pass starts
        _check_jsonl_head(f, text_field)
    halt = threading.Event()  # ends the passes early when planning fails or is interrupted

    def ranges_of(f: InputFile) -> list[dict]:
        if f.kind == "jsonl.gz":
            index, cuts = plan_gzip(f, range_bytes, halt, stall)
            return [dict(start=a, stop=b, first_line=line, est_bytes=b - a, aux=index, check=(n, crc))
                    for a, b, line, n, crc in cuts]
        # A file holding a smaller share of the corpus needs fewer ranges to keep all cores busy.
        return plan_zstd(f, range_bytes, -(-SPLIT_SHARE * f.size // packed_total), halt)

    batch: list[InputFile] = []

    def flush_text() -> None:
        if batch:
            units.append(Unit(len(units), "text", tuple(f.path for f in batch), tuple(f.name for f in batch),
                              est_bytes=sum(f.size for f in batch)))
            batch.clear()

    # The passes run side by side (zstd and zlib release the GIL); each file's ranges are its own.
    pool = ThreadPoolExecutor(min(len(big), os.cpu_count() or 1)) if big else None
    passes = {f.path: pool.submit(ranges_of, f) for f in big}
    try:
        for f in files:
            if f.kind == "text":
                batch.append(f)
                if sum(x.size for x in batch) >= unit_bytes:
                    flush_text()
                continue
            flush_text()
            if f.kind == "jsonl":
                if f.size == 0:
                    warnings.add("empty_file", f.name)
                    continue
                _check_jsonl_head(f, text_field)
                for start, stop in _line_aligned_cuts(f.path, f.size, unit_bytes):
                    units.append(Unit(len(units), "jsonl", (f.path,), (f.name,), start, stop, 0, stop - start))
            elif f.path in passes:
                for kw in passes[f.path].result():
                    units.append(Unit(len(units), f.kind, (f.path,), (f.name,), **kw))
            elif f.kind in ("jsonl.gz", "jsonl.zst"):
                _check_jsonl_head(f, text_field)
                units.append(Unit(len(units), f.kind, (f.path,), (f.name,), est_bytes=f.size * 4))
            elif f.kind == "parquet":
                for start, stop, row, nbytes in _row_group_cuts(f, unit_bytes, text_field):
                    units.append(Unit(len(units), "parquet", (f.path,), (f.name,), start, stop, row, nbytes))
            elif f.kind == "arrow":
                for start, stop, row, nbytes in _batch_cuts(f, unit_bytes, text_field):
                    units.append(Unit(len(units), "arrow", (f.path,), (f.name,), start, stop, row, nbytes))
    finally:
        if pool is not None:
            halt.set()
            pool.shutdown(wait=True, cancel_futures=True)
    flush_text()
    return units, warnings


SPLIT_BYTES = 32 << 20  # compressed bytes from which one .gz/.zst file is read by several workers
SPLIT_SHARE = 64  # ... and a file must also hold at least 1/64 of the corpus's compressed bytes
RANGE_MIN_BYTES = 32 << 20  # decompressed bytes per range of a split file
def _line_aligned_cuts(path: str, size: int, unit_bytes: int) -> Iterator[tuple[int, int]]:
    """Yield (start, stop) byte ranges that end just after the first newline at or past
    start + unit_bytes (the same cuts as line_cuts).  Only the bytes near each cut are read: the
    planner does not scan the corpus; line numbers come from the workers (LineRefs)."""
    start = 0
    with open_input(path) as fh:
        while start < size:
            pos = start + unit_bytes
            stop = size
            fh.seek(pos)
            while pos < size:
                block = fh.read(1 << 16)
                if not block:
                    break
                nl = block.find(b"\n")
                if nl >= 0:
                    stop = pos + nl + 1
                    break
                pos += len(block)
            yield start, min(stop, size)
            start = stop


def _check_jsonl_head(f: InputFile, text_field: str) -> None:
    """Fail fast when the first record lacks the text field: that is a wrong --text-field, not bad data."""
    first = None
    try:
        with open_input(f.path) as raw:
            for lineno, line in enumerate(open_stream(f.path, f.kind, raw), 1):
                if line.strip():
                    if len(line) > LONG_DOC_BYTES:  # its field names suffice: do not parse a huge text
                        line = skeleton(line)[0]
                    first = (lineno, json.loads(line))
                    break
    except Exception:  # noqa: BLE001 - bad JSON or a corrupt stream is reported, with its line, by the reader
        return
    if first and isinstance(first[1], dict) and text_field not in first[1]:
        keys = ", ".join(sorted(first[1])[:10]) or "none"
        raise InputError(f"{f.path}:{first[0]}: record has no field {text_field!r} (fields: {keys}); "
                         "pass --text-field with the name of the text field")


def _check_text_column(path: str, schema, text_field: str) -> None:
    import pyarrow as pa

    if text_field not in schema.names:
        raise InputError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
                         "pass --text-field with the name of the text column")
    typ = schema.field(text_field).type
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ)):
        raise InputError(f"{path}: column {text_field!r} has type {typ}, expected string; pass --text-field")


def _arrow_batches(path: str):
    """The record batches of an Arrow IPC file (stream format, as HF datasets writes, or file
    format), memory-mapped: reading them copies nothing."""
    import pyarrow as pa

    def source():
        return open_input(path) if is_url(path) else pa.memory_map(path)

    try:
        try:
            reader = pa.ipc.open_stream(source())
            return reader.schema, iter(reader)
        except pa.ArrowInvalid:
            f = pa.ipc.open_file(source())
            return f.schema, (f.get_batch(i) for i in range(f.num_record_batches))
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{path}: not a readable Arrow IPC file ({e}); re-create it or leave it out") from e


def _batch_cuts(f: InputFile, unit_bytes: int, text_field: str) -> Iterator[tuple[int, int, int, int]]:
    """(first batch, end batch, first row, bytes) of about unit_bytes of an Arrow file."""
    schema, batches = _arrow_batches(f.path)
    _check_text_column(f.path, schema, text_field)
    start = row = acc = first_row = n = 0
    for n, b in enumerate(batches, 1):
        acc += b.nbytes
        row += b.num_rows
        if acc >= unit_bytes:
            yield start, n, first_row, acc
            start, acc, first_row = n, 0, row
    if start < n:
        yield start, n, first_row, acc


def _parquet_source(path: str):
    return open_input(path) if is_url(path) else path


def _row_group_cuts(f: InputFile, unit_bytes: int, text_field: str) -> Iterator[tuple[int, int, int, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(_parquet_source(f.path)).metadata
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{f.path}: not a readable parquet file ({e}); re-create it or leave it out") from e
    _check_text_column(f.path, meta.schema.to_arrow_schema(), text_field)
    start, row, acc, first_row = 0, 0, 0, 0
    for rg in range(meta.num_row_groups):
        acc += meta.row_group(rg).total_byte_size
        row += meta.row_group(rg).num_rows
        if acc >= unit_bytes:
            yield start, rg + 1, first_row, acc
            start, acc, first_row = rg + 1, 0, row
    if start < meta.num_row_groups:
        yield start, meta.num_row_groups, first_row, acc


# --------------------------------------------------------------------------- reading


def _fast_text(line: bytes, field: str) -> str | None:
    """The text of a well-formed record by orjson (several times faster than json), or None
    for every other line, which then takes the exact stdlib path with its counted warnings.

    Where orjson returns a record it equals json's: it refuses what json would repair (invalid
    UTF-8, lone surrogate escapes) or read otherwise (NaN, huge numbers), and those fall back.
    """
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    text = obj.get(field) if type(obj) is dict else None
    return text if type(text) is str else None


_LINE_REF = re.compile("\x00L(\\d+):(\\d+)\x00")


class LineRefs:
    """Line numbers of plain .jsonl and .zst ranges, which are cut without counting the lines before them.

    A worker knows a line only as the n-th of its unit and writes it as a reference
    (`line_ref`); the main process, which learns every unit's line count from its journal,
    turns references into the file's line numbers in warnings and errors (`resolve`).
    """

    def __init__(self, units: list["Unit"]):
        self.units = {u.index: u for u in units}
        self.lines: dict[int, int] = {}  # unit index -> lines it holds (from its journal)

    def record(self, index: int, lines: int) -> None:
        self.lines[index] = lines

    def resolve(self, text: str) -> str:
        if "\x00" not in text:
            return text

        def line(m) -> str:
            u, n = self.units.get(int(m.group(1))), int(m.group(2))
            if u is None:
                return f"line {n} of a unit"
            before = [v.index for v in self.units.values()  # the units before it in the same file
                      if v.kind == u.kind and v.files == u.files and v.start < u.start]
            if any(i not in self.lines for i in before):  # not all read (an earlier error): say where
                return f"line {n} of {'compressed ' if u.frames else ''}bytes {u.start}-{u.stop}"
            return str(sum(self.lines[i] for i in before) + n)
        return _LINE_REF.sub(line, text)

    def resolve_tally(self, tally: "Tally") -> "Tally":
        out = Tally(first=self.resolve(tally.first) if tally.first else None)
        out.counts = dict(tally.counts)
        out.examples = {r: [self.resolve(x) for x in ex] for r, ex in tally.examples.items()}
        return out


def line_ref(unit: "Unit", n: int) -> str:
    """Line n (1-based) of a unit: its number in the file, or a reference LineRefs resolves."""
    return str(unit.first_line + n - 1) if unit.first_line else f"\x00L{unit.index}:{n}\x00"


def _bounded_lines(stream, cap: int) -> Iterator[bytes | int]:
    """The lines of `stream`, each longer than `cap` bytes given as its length, never held whole."""
    if not isinstance(stream, io.BufferedReader):  # an object store's file: its readline takes no size
        stream = io.BufferedReader(stream, 1 << 20)
    while line := stream.readline(cap + 1):
        if len(line) <= cap or line.endswith(b"\n"):
            yield line
            continue
        n = len(line)
        while (more := stream.readline(cap + 1)) and not more.endswith(b"\n"):
            n += len(more)
        yield n + len(more)


def source_of(name: str) -> str:
    """A file's source, for per-source counts (mixture weights): its top-level folder under the
    corpus root; "." for the files directly in it."""
    return name.split("/", 1)[0] if "/" in name else "."


class StaleRange(Exception):
    """A .gz range did not read as planned (its lines and CRC-32): its seek index is damaged, or,
    read without one, the file changed.  Raised at the range's end: what was read must be discarded."""

    def __init__(self, unit: Unit):
        super().__init__(unit.names[0])
        self.unit = unit


class UnitReader:
    """Iterate the documents of a unit; `consumed` tracks input bytes read (for progress).

    Skips and repairs go to `tally`; fatal problems raise InputError naming file and line.
    """

    def __init__(self, unit: Unit, text_field: str, tally: Tally, *, long_bytes: int | None = None,
                 skip_lines_over: int | None = None):
        self.unit = unit
        # A sample's reader: JSON lines longer than this are passed over without being held in
        # memory (one 200 MB line read whole to sample 128 K characters of it ran out of memory).
        self.skip_lines_over = skip_lines_over
        self.text_field = text_field
        self.tally = tally
        self.long_bytes = long_bytes  # documents above this many bytes come as LongText (None: never)
        self.consumed = 0
        self.lines = 0  # lines of a .jsonl unit read so far (all of them once it is read through)
        self._loc: tuple = ("", None, "")

    def source(self) -> str:
        """The source of the document last yielded: source_of its file."""
        return source_of(self._loc[0])

    def where(self) -> str:
        """Location of the document last yielded: file, file:line, or file row N."""
        name, n, sep = self._loc
        if n is None:
            return name
        return f"{name}:{line_ref(self.unit, n)}" if sep == ":" else f"{name}{sep}{n}"

    def __iter__(self) -> Iterator[str | LongText]:
        kind = self.unit.kind
        if kind == "text":
            yield from self._text()
        elif kind == "parquet":
            yield from self._parquet()
        elif kind == "arrow":
            yield from self._arrow()
        else:
            yield from self._jsonl()

    def _text(self) -> Iterator[str]:
        for path, name in zip(self.unit.files, self.unit.names):
            with open_input(path) as fh:
                size = size_of(fh)
                data = None if self.long_bytes is not None and size > self.long_bytes else fh.read()
            if data is None:
                self.consumed += size
                self._loc = (name, None, "")
                yield long_text_file(path, name, self.tally)
                continue
            self.consumed += len(data)
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                text = data.decode("utf-8", "replace")
                self.tally.add("invalid_utf8_repaired", f"{name} (byte {e.start})")
            del data  # hold one copy of a huge document while it is tokenized, not two
            if text.startswith("\ufeff"):  # a BOM is an encoding marker, not text
                text = text[1:]
            self._loc = (name, None, "")
            yield text

    def _gz_range(self, path: str, raw):
        """A stream at the start of this .gz range: through its seek index (`aux`), or, with none or
        a damaged one (dropped from the cache), by decompressing up to it."""
        u = self.unit
        if u.aux:
            import indexed_gzip

            try:
                stream = indexed_gzip.IndexedGzipFile(fileobj=raw, readbuf_size=1 << 20)
                stream.import_index(u.aux)
                stream.seek(u.start)
                return io.BufferedReader(stream, 1 << 20)
            except Exception:  # noqa: BLE001 - whatever a damaged index makes the library raise
                drop_index(u.aux)  # nothing read yet: read this range without it
                self.unit = dataclasses.replace(u, aux="")
                raw.seek(0)
        stream = open_stream(path, u.kind, raw)
        left = u.start
        while left and (got := stream.read(min(left, 8 << 20))):
            left -= len(got)
        return stream

    def _jsonl(self) -> Iterator[str]:
        u = self.unit
        path, name = u.files[0], u.names[0]
        n = 0  # lines read in this unit

        def at() -> str:  # where line n is, for a warning
            return f"{name}:{line_ref(u, n)}"
        with open_input(path) as raw:
            gz_range = u.kind == "jsonl.gz" and u.stop
            if gz_range:  # a line range of a large .gz file: from its seek point, or decompressed up to it
                stream = self._gz_range(path, raw)
                u = self.unit  # without its seek index, if that was found damaged
            elif u.kind == "jsonl.zst" and u.stop:  # a range of a large .zst: from its frame's start
                raw.seek(u.seek[0])
                stream = io.BufferedReader(z := ZstdRaw(raw, u.seek[0]), 1 << 20)
            else:
                stream = open_stream(path, u.kind, raw)
            if u.kind == "jsonl":
                raw.seek(u.start)
            # A range owns the lines that begin before `limit` bytes into what it reads (a .zst range
            # reads from the byte before its start); a run of frames learns its limit as it
            # decompresses; None: to the end (stop == 0: a whole file).
            zst_range = u.kind == "jsonl.zst" and u.stop and u.start
            limit = None if not u.stop or u.frames else u.stop - u.start + (1 if zst_range else 0)
            pos = seen = crc = 0  # bytes read; frames of a run already looked at for its limit
            fast_field = self.text_field if orjson is not None else None
            try:
                if zst_range:  # the line holding the byte before (a run: its first byte) is the range before's
                    z.skip(u.skip_bytes)
                    while (part := stream.readline(1 << 20)) and not part.endswith(b"\n"):
                        pos += len(part)
                    pos += len(part)
                for line in (stream if self.skip_lines_over is None else _bounded_lines(stream, self.skip_lines_over)):
                    if isinstance(line, int):  # a line passed over (a sample's reader): its length
                        pos += line
                        n += 1
                        if limit is not None and pos >= limit:
                            break
                        continue
                    if u.frames and limit is None and len(z.frames) > seen:  # once the next run's first frame begins
                        limit = next((d + 1 for c, d in z.frames[seen:] if c >= u.stop), None)
                        seen = len(z.frames)
                    if limit is not None and pos >= limit:
                        if u.ends_file:  # frame headers planned without decompressing understated the data
                            raise OSError("corrupt zstd data: more than its frame headers declare")
                        break
                    pos += len(line)
                    if gz_range:
                        crc = zlib.crc32(line, crc)
                    self.consumed = raw.tell() if not u.stop else (raw.tell() - u.start) * 4 if u.frames else pos
                    n += 1
                    self.lines = n
                    if n == 1 and u.start == 0 and line.startswith(b"\xef\xbb\xbf"):
                        line = line[3:]
                    if not line or line.isspace():  # isspace, not strip: no copy of every line
                        continue
                    if fast_field is not None and (self.long_bytes is None or len(line) <= self.long_bytes):
                        text = _fast_text(line, fast_field)
                        if text is not None:
                            line = None
                            self._loc = (name, n, ":")
                            yield text
                            continue
                    if self.long_bytes is not None and len(line) > self.long_bytes:
                        text = self._long_line(line, at())
                        line = None
                        if text is not None:
                            self._loc = (name, n, ":")
                            yield text
                        continue
                    try:
                        s = line.decode("utf-8")
                    except UnicodeDecodeError:
                        s = line.decode("utf-8", "replace")
                        self.tally.add("invalid_utf8_repaired", at())
                    line = None  # a huge line: never hold its bytes, text and parsed copy at once
                    try:
                        obj = json.loads(s)
                        s = None
                    except ValueError as e:
                        # json's message for a control character ends in "at" (its own position follows)
                        msg = str(getattr(e, "msg", e)).removesuffix(" at")
                        self.tally.add("malformed_json", f"{at()} ({msg} at column {getattr(e, 'colno', '?')})")
                        continue
                    text = self._field(obj, at())
                    obj = None  # only the text stays alive while it is tokenized
                    if text is None:
                        continue
                    self._loc = (name, n, ":")
                    yield text
                if u.ends_file and pos != limit:  # the data ended before or after the end its headers declare
                    raise OSError(f"corrupt zstd data: {'less' if pos < limit else 'more'} than its frame "
                                  "headers declare")
                if gz_range and (pos, n, crc) != (limit, *u.check):
                    raise StaleRange(u)
            except StaleRange:
                raise
            except (EOFError, OSError, zlib.error) as e:
                if expired(e):
                    raise
                if u.aux:  # the index may be what is damaged: the caller reads the range again without it
                    raise StaleRange(u) from e
                raise damaged(path, u.kind, e, "truncated or corrupt") from e
            except Exception as e:
                if type(e).__name__ == "ZstdError":
                    raise damaged(path, u.kind, e, "corrupt zstd stream") from e
                if u.aux and type(e).__name__ == "ZranError":
                    raise StaleRange(u) from e
                raise

    def _field(self, obj, where: str, resolve=None) -> str | LongText | None:
        """The text field of a parsed record, or None (counted) when it has none."""
        if not isinstance(obj, dict):
            self.tally.add("not_an_object", where)
            return None
        text = obj.get(self.text_field)
        if text is None:
            self.tally.add("missing_text" if self.text_field not in obj else "null_text", where)
            return None
        if not isinstance(text, str):
            self.tally.add("non_string_text", f"{where} ({type(text).__name__})")
            return None
        if resolve is not None:
            text = resolve(text)
            if isinstance(text, LongText):
                return text
        if not text.isascii() and SURROGATE.search(text):
            text = repair_surrogates(text)
            self.tally.add("lone_surrogate_repaired", where)
        return text

    def _long_line(self, line: bytes, where: str) -> str | LongText | None:
        parsed = parse_long_line(line, where, self.tally)
        return None if parsed is None else self._field(parsed[0], where, parsed[1])

    def _column(self, column, row: int) -> Iterator[str]:
        """The texts of one Arrow column chunk; nulls are counted, with their row."""
        name = self.unit.names[0]
        for text in column.to_pylist():
            if text is None:
                self.tally.add("null_text", f"{name} row {row}")
            else:
                self._loc = (name, row, " row ")
                yield text
            row += 1

    def _arrow(self) -> Iterator[str]:
        u = self.unit
        row = u.first_line
        _, batches = _arrow_batches(u.files[0])
        for i, b in enumerate(batches):
            if i >= u.stop:
                break
            if i >= u.start:
                yield from self._column(b.column(self.text_field), row)
                row += b.num_rows
                self.consumed += b.nbytes

    def _parquet(self) -> Iterator[str]:
        import pyarrow.parquet as pq

        u = self.unit
        pf = pq.ParquetFile(_parquet_source(u.files[0]))
        row = u.first_line
        for rg in range(u.start, u.stop):
            meta = pf.metadata.row_group(rg)
            table = pf.read_row_group(rg, columns=[self.text_field])
            yield from self._column(table.column(0), row)
            row += meta.num_rows
            self.consumed += meta.total_byte_size
