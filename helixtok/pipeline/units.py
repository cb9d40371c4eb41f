"""Cut the corpus files into work units: whole files, line-aligned ranges, row groups."""

from __future__ import annotations

import json
import os
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

try:
    import orjson
except ImportError:  # optional speed-up: the stdlib path reads every line the same way
    orjson = None

from ..format import limits
from ..format.errors import InputError
from ..format.objstore import is_url, open_input
from .compressed import open_stream, plan_gzip, plan_zstd
from .inputfile import InputFile
from .longdoc import skeleton
from .tally import Tally

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
    [start, stop), first_line the index of its first row.  array: a whole .json(.gz/.zst) file
    holding one JSON array of records (HF users' `to_json(lines=False)`), its elements the records.
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
    array: bool = False  # a .json file holding one JSON array of records: read whole, by one reader


    @property
    def skip_bytes(self) -> int:
        """Decompressed bytes a reader discards before this unit (a .zst range inside a frame): up to
        the byte before `start`, from which it finds where the range's first line begins."""
        return max(0, self.start - 1 - self.seek[1]) if self.kind == "jsonl.zst" and self.stop and not self.frames else 0

    def to_json(self) -> dict:
        return {"kind": self.kind, "files": list(self.names), "start": self.start, "stop": self.stop,
                "est_bytes": self.est_bytes, **({"array": True} if self.array else {})}


def plan_units(files: list[InputFile], *, unit_bytes: int, text_field: str, stall: float = 600.0,
               chat: bool = False, any_fields: bool = False) -> tuple[list[Unit], Tally]:
    """The work units of `files`; chat: the field holds conversations (a list), not text; any_fields:
    records are handed whole to a --map function (no text field is looked for)."""
    if any_fields:
        text_field = None
    units: list[Unit] = []
    warnings = Tally()
    # A compressed file is split into ranges when it is large in absolute terms and relative
    # to the corpus (a corpus of many such files is already parallel; splitting costs a pass over
    # each).  Both are functions of the input alone: the units do not depend on --workers.
    packed_total = sum(f.size for f in files if f.kind in ("jsonl.gz", "jsonl.zst"))
    split_at = max(limits.SPLIT_BYTES, packed_total // limits.SPLIT_SHARE)
    range_bytes = max(unit_bytes, limits.RANGE_MIN_BYTES)
    arrays = {f.path for f in files if f.kind in ("jsonl", "jsonl.gz", "jsonl.zst") and json_array_file(f)}
    big = [f for f in files if f.kind in ("jsonl.gz", "jsonl.zst") and f.size >= split_at and f.path not in arrays]
    for f in big:  # a wrong --text-field fails before any long pass starts
        _check_jsonl_head(f, text_field, chat)
    halt = threading.Event()  # ends the passes early when planning fails or is interrupted

    def ranges_of(f: InputFile) -> list[dict]:
        if f.kind == "jsonl.gz":
            index, cuts = plan_gzip(f, range_bytes, halt, stall)
            return [dict(start=a, stop=b, first_line=line, est_bytes=b - a, aux=index, check=(n, crc))
                    for a, b, line, n, crc in cuts]
        # A file holding a smaller share of the corpus needs fewer ranges to keep all cores busy.
        return plan_zstd(f, range_bytes, -(-limits.SPLIT_SHARE * f.size // packed_total), halt)

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
            if f.path in arrays:  # one JSON array: parsed whole, so one unit
                units.append(Unit(len(units), f.kind, (f.path,), (f.name,), est_bytes=f.size * (1 if f.kind == "jsonl"
                                                                                                  else 4), array=True))
            elif f.kind == "jsonl":
                if f.size == 0:
                    warnings.add("empty_file", f.name)
                    continue
                _check_jsonl_head(f, text_field, chat)
                for start, stop in _line_aligned_cuts(f.path, f.size, unit_bytes):
                    units.append(Unit(len(units), "jsonl", (f.path,), (f.name,), start, stop, 0, stop - start))
            elif f.path in passes:
                for kw in passes[f.path].result():
                    units.append(Unit(len(units), f.kind, (f.path,), (f.name,), **kw))
            elif f.kind in ("jsonl.gz", "jsonl.zst"):
                _check_jsonl_head(f, text_field, chat)
                units.append(Unit(len(units), f.kind, (f.path,), (f.name,), est_bytes=f.size * 4))
            elif f.kind == "parquet":
                for start, stop, row, nbytes in _row_group_cuts(f, unit_bytes, text_field, chat):
                    units.append(Unit(len(units), "parquet", (f.path,), (f.name,), start, stop, row, nbytes))
            elif f.kind == "arrow":
                for start, stop, row, nbytes in _batch_cuts(f, unit_bytes, text_field, chat):
                    units.append(Unit(len(units), "arrow", (f.path,), (f.name,), start, stop, row, nbytes))
    finally:
        if pool is not None:
            halt.set()
            pool.shutdown(wait=True, cancel_futures=True)
    flush_text()
    return units, warnings


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


def field_value(obj: dict, field: str) -> tuple[bool, object]:
    """(found, value) of --text-field in a record: the key itself, else a dotted path into nested
    objects (`meta.text`: obj["meta"]["text"]), as Megatron's --json-keys users write it."""
    if field in obj:
        return True, obj[field]
    if "." not in field:
        return False, None
    for part in field.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return False, None
        obj = obj[part]
    return True, obj


def arrow_field(schema, field: str) -> list[str] | None:
    """Where --text-field is in an Arrow schema: [the column], or (a dotted path) the column and
    the names of the struct fields down to it; None when it is neither."""
    import pyarrow as pa

    if field in schema.names:
        return [field]
    path = field.split(".")
    if len(path) < 2 or path[0] not in schema.names:
        return None
    typ = schema.field(path[0]).type
    for p in path[1:]:
        if not pa.types.is_struct(typ) or typ.get_field_index(p) < 0:
            return None
        typ = typ.field(p).type
    return path


def arrow_leaf(column, path: list[str]):
    """The (chunked) array at `path` (arrow_field's) below a column holding path[0]."""
    import pyarrow.compute as pc

    for p in path[1:]:
        column = pc.struct_field(column, p)
    return column


def json_array_file(f: InputFile) -> bool:
    """A file named .json(.gz/.zst) whose first non-blank byte opens a JSON array."""
    if re.search(r"\.json(\.gz|\.zst|\.zstd)?$", f.path.lower()) is None:
        return False
    try:
        with open_input(f.path) as raw:
            head = open_stream(f.path, f.kind, raw).read(1 << 16)
    except Exception:  # noqa: BLE001 - a damaged stream is reported, with its line, by the reader
        return False
    return head.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def _check_jsonl_head(f: InputFile, text_field: str | None, chat: bool = False) -> None:
    """Fail fast when the first record lacks the text field: that is a wrong --text-field, not bad
    data.  A file named .json* (C4 and Dolma name JSON Lines so) whose first line is not one JSON
    object holds a single JSON document: refused, with how to convert it.  text_field None: any
    record will do (a --map build)."""
    first = None
    named_json = re.search(r"\.json(\.gz|\.zst|\.zstd)?$", f.path.lower()) is not None
    last = (text_field or "").rsplit(".", 1)[-1]  # a dotted path's last key: on that line, somewhere
    key = re.compile(rb'"' + re.escape(json.dumps(last)[1:-1].encode()) + rb'"\s*:')
    try:
        with open_input(f.path) as raw:
            stream, lineno = open_stream(f.path, f.kind, raw), 0
            # Lines read up to limits.LONG_DOC_BYTES: a huge first line is not held whole (iterating the
            # stream built it in a growing buffer, twice its size: a 200 MB line peaked at 400 MB).
            while line := stream.readline(limits.LONG_DOC_BYTES + 1):
                lineno += 1
                if len(line) > limits.LONG_DOC_BYTES and not line.endswith(b"\n"):
                    if not line.lstrip().startswith(b"{"):
                        first = (lineno, None)  # not one object (an array?)
                        break
                    if key.search(line):
                        return  # its field is there: the record is the reader's to judge
                    line = skeleton(line + stream.readline())[0]  # rare: a huge other field before it
                if line.strip():
                    try:
                        first = (lineno, json.loads(line))
                    except (ValueError, RecursionError):
                        first = (lineno, None)
                    break
    except Exception:  # noqa: BLE001 - a corrupt stream is reported, with its line, by the reader
        return
    if named_json and first is not None and not isinstance(first[1], dict):
        cat = {"jsonl": "", "jsonl.gz": "gzip -dc", "jsonl.zst": "zstd -dc"}[f.kind]
        src = f"{cat} {f.path} | jq -c '.[]'" if cat else f"jq -c '.[]' {f.path}"
        stem = re.sub(r"\.json(\.gz|\.zst|\.zstd)?$", "", f.path, flags=re.I)
        raise InputError(f"{f.path}:{first[0]}: not JSON Lines (its first line is not one JSON object) nor one JSON "
                         f"array of objects: a file named .json is read as either; convert it to JSON Lines: "
                         f"{src} > {stem}.jsonl")
    if first is None or first[1] is None:  # bad JSON is reported, with its line, by the reader
        return
    if text_field is not None and first and isinstance(first[1], dict) and not field_value(first[1], text_field)[0]:
        trl = "prompt" in first[1] and "completion" in first[1]  # TRL's prompt/completion form
        if chat and trl:
            return  # (a chat build reads it as TRL does: chat.prompt_completion)
        keys = ", ".join(sorted(first[1])[:10]) or "none"
        chats = [k for k, v in first[1].items() if isinstance(v, list) and v and isinstance(v[0], dict) and "role" in v[0]]
        raise InputError(f"{f.path}:{first[0]}: record has no field {text_field!r} (fields: {keys}); "
                         "pass --text-field with the name of the text field"
                         + (f"; {chats[0]!r} holds chat messages: build conversations with --chat" if chats else
                            "; prompt/completion rows (TRL's form): build them with --chat" if trl else ""))


def _check_text_column(path: str, schema, text_field: str | None, chat: bool = False) -> None:
    import pyarrow as pa

    if text_field is None:  # a --map build: the rows go to its function whole
        return
    where = arrow_field(schema, text_field) if not chat else [text_field] if text_field in schema.names else None
    if where is None and chat and {"prompt", "completion"} <= set(schema.names):
        return  # TRL's prompt/completion form (chat.prompt_completion)
    if where is None:
        raise InputError(f"{path}: no column {text_field!r} (columns: {', '.join(schema.names)}); "
                         "pass --text-field with the name of the text column (a.b: field b of struct column a)")
    typ = schema.field(where[0]).type
    for p in where[1:]:
        typ = typ.field(p).type
    if chat:
        if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)):
            raise InputError(f"{path}: column {text_field!r} has type {typ}, expected a list of messages; "
                             "pass --text-field with the conversations' column")
        return
    if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_string_view(typ)):
        raise InputError(f"{path}: column {text_field!r} has type {typ}, expected string; pass --text-field")


def arrow_batches(path: str):
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


def _batch_cuts(f: InputFile, unit_bytes: int, text_field: str, chat: bool) -> Iterator[tuple[int, int, int, int]]:
    """(first batch, end batch, first row, bytes) of about unit_bytes of an Arrow file."""
    schema, batches = arrow_batches(f.path)
    _check_text_column(f.path, schema, text_field, chat)
    start = row = acc = first_row = n = 0
    for n, b in enumerate(batches, 1):
        acc += b.nbytes
        row += b.num_rows
        if acc >= unit_bytes:
            yield start, n, first_row, acc
            start, acc, first_row = n, 0, row
    if start < n:
        yield start, n, first_row, acc


def parquet_source(path: str):
    return open_input(path) if is_url(path) else path


def _row_group_cuts(f: InputFile, unit_bytes: int, text_field: str, chat: bool) -> Iterator[tuple[int, int, int, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(parquet_source(f.path)).metadata
    except (pa.ArrowException, OSError) as e:
        raise InputError(f"{f.path}: not a readable parquet file ({e}); re-create it or leave it out") from e
    _check_text_column(f.path, meta.schema.to_arrow_schema(), text_field, chat)
    start, row, acc, first_row = 0, 0, 0, 0
    for rg in range(meta.num_row_groups):
        acc += meta.row_group(rg).total_byte_size
        row += meta.row_group(rg).num_rows
        if acc >= unit_bytes:
            yield start, rg + 1, first_row, acc
            start, acc, first_row = rg + 1, 0, row
    if start < meta.num_row_groups:
        yield start, meta.num_row_groups, first_row, acc
