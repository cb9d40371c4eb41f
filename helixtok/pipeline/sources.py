"""Read the documents out of a work unit: text files, JSON lines (plain, .gz, .zst), Parquet, Arrow."""

from __future__ import annotations

import dataclasses
import io
import json
import re
import zlib
from typing import Iterator

try:
    import orjson
except ImportError:  # optional speed-up: the stdlib path reads every line the same way
    orjson = None

from ..format.errors import InputError
from ..format.objstore import expired, open_input, size_of
from .compressed import ZstdRaw, damaged, drop_index, open_stream
from .longdoc import NESTED, SURROGATE, LongText, long_text_file, parse_long_line, repair_surrogates
from .tally import Tally
from .units import Unit, arrow_batches, arrow_field, arrow_leaf, field_value, parquet_source

# --------------------------------------------------------------------------- reading


def _fast_text(line: bytes, field: str) -> tuple[str | None, dict | None]:
    """The text of a well-formed record by orjson (several times faster than json), and the record;
    (None, None) for every other line, which then takes the exact stdlib path with its counted warnings.

    Where orjson returns a record it equals json's: it refuses what json would repair (invalid
    UTF-8, lone surrogate escapes) or read otherwise (NaN, huge numbers), and those fall back.
    """
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None, None
    text = (obj.get(field) if "." not in field else field_value(obj, field)[1]) if type(obj) is dict else None
    return (text, obj) if type(text) is str else (None, None)


FIELD_BYTES = 1024  # a kept field's value (--keep-fields) at most this long as JSON; a longer one is not kept


def pick_fields(obj: dict, names: tuple[str, ...], where: str, tally: Tally) -> dict | None:
    """The --keep-fields of a record that has them (a dotted name reaches into nested objects, as
    --text-field does), as JSON values; None when it has none.  A value longer than FIELD_BYTES as
    JSON is left out, counted as `field_too_long` (the fields are for ids and labels, not text)."""
    out = None
    for n in names:
        found, v = field_value(obj, n)
        if not found or v is None:
            continue
        try:  # as JSON (a Parquet timestamp or decimal: its str), the same in every process and journal
            text = json.dumps(v, ensure_ascii=False, default=str)
        except (TypeError, ValueError, RecursionError):
            text = None
        size = FIELD_BYTES + 1 if text is None else len(text.encode())
        if size > FIELD_BYTES:
            tally.add("field_too_long", f"{where} ({n}: {size:,} bytes as JSON, over {FIELD_BYTES:,})")
            continue
        if out is None:
            out = {}
        out[n] = v if type(v) in (str, int, bool) else json.loads(text)
    return out


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


def _lines(stream, cap: int, whole: bool) -> Iterator[bytes | bytearray | int]:
    """The lines of `stream`.  One longer than `cap` bytes is never built by the stream itself (it
    copies a growing buffer: a 200 MB line peaked at twice its size): with `whole` it is gathered in
    a bytearray grown in place; else only its length is given (a sample's reader passes it over)."""
    if not isinstance(stream, io.BufferedReader):  # an object store's file: its readline takes no size
        stream = io.BufferedReader(stream, 1 << 20)
    while line := stream.readline(cap + 1):
        if len(line) <= cap or line.endswith(b"\n"):
            yield line
            continue
        n, buf = len(line), bytearray(line) if whole else None
        line = None
        while more := stream.readline(1 << 20):
            n += len(more)
            if buf is not None:
                buf += more
            if more.endswith(b"\n"):
                break
        yield buf if buf is not None else n


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


# A chat row's columns besides its messages: tools, per-row template kwargs, and a TRL
# prompt/completion row's two (chat.py reads them; a Parquet/Arrow unit reads no other column).
ROW_COLUMNS = ("tools", "chat_template_kwargs", "prompt", "completion")


class UnitReader:
    """Iterate the documents of a unit; `consumed` tracks input bytes read (for progress).

    Skips and repairs go to `tally`; fatal problems raise InputError naming file and line.
    """

    def __init__(self, unit: Unit, text_field: str, tally: Tally, *, long_bytes: int | None = None,
                 skip_lines_over: int | None = None, records: bool = False, mapper: "RecordMap | None" = None,
                 keep: tuple[str, ...] = ()):
        self.unit = unit
        # --keep-fields: the fields of the record last yielded (`kept`: a dict, or None without any).
        self.keep = tuple(keep)
        self.kept: dict | None = None
        # A chat build's reader: each record whole (a dict), its conversation judged by chat.py.
        self.records = records or mapper is not None
        # A --map build's: its documents are what the function makes of each record, read whole
        # (every column of a Parquet/Arrow row), so no document is read in pieces.
        self.mapper = mapper
        self.whole_rows = mapper is not None
        if mapper is not None:
            long_bytes = None
        # A sample's reader: JSON lines longer than this are passed over without being held in
        # memory (one 200 MB line read whole to sample 128 K characters of it ran out of memory).
        self.skip_lines_over = skip_lines_over
        self.text_field = text_field
        self.tally = tally
        self.long_bytes = long_bytes  # documents above this many bytes come as LongText (None: never)
        self.consumed = 0
        self.lines = 0  # lines of a .jsonl unit read so far (all of them once it is read through)
        self._loc: tuple = ("", None, "")
        self._file = 0  # a text unit: which of its files was read last

    def source(self) -> str:
        """The source of the document last yielded: source_of its file."""
        return source_of(self._loc[0])

    def offset(self) -> int:
        """The record last yielded, as its place in this unit: a text unit's file (0, 1, ...), a
        JSON lines unit's line or an array's element (0-based from the unit's first), a Parquet or
        Arrow unit's row from its first.  What a document's `.src` entry holds (docs/format.md)."""
        name, n, sep = self._loc
        if n is None:
            return self._file
        return n - self.unit.first_line if sep == " row " else n - 1

    def where(self) -> str:
        """Location of the document last yielded: file, file:line, or file row N."""
        name, n, sep = self._loc
        if n is None:
            return name
        return f"{name}:{line_ref(self.unit, n)}" if sep == ":" else f"{name}{sep}{n}"

    def __iter__(self) -> Iterator[str | LongText]:
        if self.mapper is None:
            yield from self._documents()
            return
        for rec in self._documents():  # the record (a text file's: its text and name) to its text, or skipped
            got = self.mapper(rec if isinstance(rec, dict) else {"text": rec, "file": self.where()}, self.where(),
                              self.tally)
            if got is not None:
                yield got

    def _documents(self) -> Iterator[str | LongText]:
        kind = self.unit.kind
        if kind == "text":
            yield from self._text()
        elif kind == "parquet":
            yield from self._parquet()
        elif kind == "arrow":
            yield from self._arrow()
        elif self.unit.array:
            yield from self._json_array()
        else:
            yield from self._jsonl()

    def _text(self) -> Iterator[str]:
        for self._file, (path, name) in enumerate(zip(self.unit.files, self.unit.names)):
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

    def _json_array(self) -> Iterator[str]:
        """A .json file holding one JSON array: parsed whole (in memory: JSON Lines is the form for
        large data), each element a record, located as `file element N`."""
        u = self.unit
        path, name = u.files[0], u.names[0]
        with open_input(path) as raw:
            try:
                data = open_stream(path, u.kind, raw).read()
            except (OSError, EOFError, ValueError) as e:  # a damaged compressed stream, said as such
                raise InputError(f"{name}: cannot be read ({e}); re-create it or leave it out") from None
        self.consumed += len(data)
        try:
            items = json.loads(data.decode("utf-8-sig"))
        except (ValueError, RecursionError) as e:
            raise InputError(f"{name}: not one valid JSON array ({str(e)[:120]}); fix the file or write it as JSON "
                             "Lines (one object per line)") from None
        del data
        for n, obj in enumerate(items, 1):
            self._loc = (name, n, " element ")
            got = self._field(obj, f"{name} element {n}")
            if got is not None:
                yield got

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
                lines = (_lines(stream, self.skip_lines_over, whole=False) if self.skip_lines_over is not None
                         else _lines(stream, self.long_bytes, whole=True) if self.long_bytes is not None else stream)
                for line in lines:
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
                    if fast_field is not None and not self.records and (self.long_bytes is None or len(line) <= self.long_bytes):
                        text, obj = _fast_text(line, fast_field)
                        if text is not None:
                            line = None
                            if self.keep:
                                self.kept = pick_fields(obj, self.keep, at(), self.tally)
                            obj = None
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
                    except RecursionError:  # json's decoder nests as deep as the line: past ~1,000 levels
                        self.tally.add("malformed_json", f"{at()} ({NESTED})")
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
        if self.keep:
            self.kept = pick_fields(obj, self.keep, where, self.tally)
        if self.records:
            return obj
        found, text = field_value(obj, self.text_field)
        if text is None:
            self.tally.add("null_text" if found else "missing_text", where)
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

    def _column(self, column, row: int, table=None) -> Iterator[str]:
        """The texts of one Arrow column chunk; nulls are counted, with their row.  `table`: the
        --keep-fields columns beside it."""
        name = self.unit.names[0]
        extra = table.to_pylist() if table is not None and table.num_columns else None
        for i, text in enumerate(column.to_pylist()):
            if text is None:
                self.tally.add("null_text", f"{name} row {row}")
            else:
                self._loc = (name, row, " row ")
                if self.keep:
                    self.kept = pick_fields(extra[i], self.keep, f"{name} row {row}", self.tally) if extra else None
                yield text
            row += 1

    def _rows(self, table, row: int) -> Iterator[dict]:
        """The records of an Arrow table (or batch), one dict each, with their row."""
        name = self.unit.names[0]
        for rec in table.to_pylist():
            self._loc = (name, row, " row ")
            if self.keep:
                self.kept = pick_fields(rec, self.keep, f"{name} row {row}", self.tally)
            yield rec
            row += 1

    def _kept_columns(self, names: list[str]) -> list[str]:
        """The columns of a Parquet/Arrow schema that --keep-fields reaches (a dotted name: its first part)."""
        return [c for c in dict.fromkeys(k.split(".")[0] if k not in names else k for k in self.keep) if c in names]

    def _arrow(self) -> Iterator[str]:
        u = self.unit
        row = u.first_line
        _, batches = arrow_batches(u.files[0])
        for i, b in enumerate(batches):
            if i >= u.stop:
                break
            if i >= u.start:
                if self.records:
                    yield from self._rows(b if self.whole_rows else b.select(
                        [c for c in dict.fromkeys((self.text_field, *ROW_COLUMNS, *self._kept_columns(b.schema.names)))
                         if c in b.schema.names]), row)
                else:
                    where = arrow_field(b.schema, self.text_field)
                    yield from self._column(arrow_leaf(b.column(where[0]), where), row,
                                            b.select(self._kept_columns(b.schema.names)) if self.keep else None)
                row += b.num_rows
                self.consumed += b.nbytes

    def _parquet(self) -> Iterator[str]:
        import pyarrow.parquet as pq

        u = self.unit
        pf = pq.ParquetFile(parquet_source(u.files[0]))
        row = u.first_line
        for rg in range(u.start, u.stop):
            meta = pf.metadata.row_group(rg)
            names = pf.schema_arrow.names
            if self.records:  # the conversations and, when there, their tools (--map: the whole row)
                cols = None if self.whole_rows else [c for c in dict.fromkeys(
                    (self.text_field, *ROW_COLUMNS, *self._kept_columns(names))) if c in names]
                yield from self._rows(pf.read_row_group(rg, columns=cols), row)
            else:
                where = arrow_field(pf.schema_arrow, self.text_field)
                table = pf.read_row_group(rg, columns=[".".join(where)])
                kept = pf.read_row_group(rg, columns=self._kept_columns(names)) if self.keep else None
                yield from self._column(arrow_leaf(table.column(0), where), row, kept)
            row += meta.num_rows
            self.consumed += meta.total_byte_size


# --------------------------------------------------------------------------- a record hook (--map)


class Skip:
    """What a --map function returns to leave a record out, with why: counted in the manifest's
    `skipped` as "map:<reason>" (returning None counts as "map:none")."""

    def __init__(self, reason: str = "none"):
        self.reason = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(reason))[:64] or "none"


class RecordMap:
    """A build's --map in a tokenizing process: each record to its text, or a counted skip."""

    @classmethod
    def of(cls, cfg) -> "RecordMap | None":
        """The --map of BuildConfig `cfg`, or None."""
        return cls(cfg.transform, cfg.transform_sha256) if cfg.transform is not None else None

    def __init__(self, spec: str, sha: str):
        from .config import load_map, map_spec

        self.fn = load_map(spec)
        if map_spec(self.fn)[1] != sha:
            raise InputError(f"--map {spec}: its source changed since the build was planned; rerun the command "
                             "(--overwrite if it is meant to change the data)")
        self.spec = spec

    def __call__(self, record, where: str, tally: Tally) -> str | None:
        try:
            got = self.fn(record)
        except Exception as e:  # noqa: BLE001 - the user's function, said with the record it failed on
            raise InputError(f"{where}: --map {self.spec} raised {type(e).__name__}: {str(e)[:200]}; fix the function "
                             "(or return None / helixtok.Skip(reason) to leave such a record out)") from None
        if isinstance(got, str):
            return got
        if got is None or isinstance(got, Skip):
            tally.count(f"map:{got.reason if got is not None else 'none'}", where)
            return None
        raise InputError(f"{where}: --map {self.spec} returned a {type(got).__name__}; it returns the document's text "
                         "(a str), None or helixtok.Skip(reason)")
