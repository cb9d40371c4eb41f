"""Documents too large to hold as one str: validated once, then handed out as str pieces.

A 50 MB document costs 4-5x its size when parsed whole (CPython's json builds its result in
a growing buffer; a str with one wide character takes 2-4 bytes per character).  Read in
pieces, it costs its raw bytes (a JSON line) or nothing (a text file) beyond a constant.
Pieces end only where no UTF-8 sequence or JSON escape is cut, so the pieces joined are
exactly the text a whole-document read gives.
"""

from __future__ import annotations

import codecs
import json
import re
import uuid
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator

from ..format import limits
from ..format.objstore import open_input


_COLON = re.compile(rb"[ \t\r\n]*:")
# A piece may end after any ASCII byte except these: a backslash, or what can follow one
# inside an escape (`u` and hex digits of \uXXXX, so surrogate pairs also stay together).
_UNSAFE_END = frozenset(b"\\u0123456789abcdefABCDEF")
NESTED = "nested too deeply: more levels of arrays and objects than a JSON reader follows"
SURROGATE = re.compile("[\ud800-\udfff]")  # searched, not encoded: no copy of a huge text


def repair_surrogates(text: str) -> str:
    """Replace lone surrogates (from JSON escapes like \\ud800) with U+FFFD."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


@dataclass
class LongText:
    """One long document: `pieces()` yields it as str pieces, afresh on every call."""

    pieces: Callable[[], Iterator[str]]

    def head(self, n: int) -> str:
        out, got = [], 0
        for p in self.pieces():
            out.append(p[: n - got])
            got += len(out[-1])
            if got >= n:
                break
        return "".join(out)


def stripped(pieces: Iterator[str]) -> Iterator[str]:
    """The pieces of text.strip(): leading whitespace skipped, trailing whitespace held back
    until more text follows it (so a run inside the text is kept, one at the end is not)."""
    started, pending = False, ""
    for p in pieces:
        if not started:
            p = p.lstrip()
            if not p:
                continue
            started = True
        body = p.rstrip()
        if not body:
            pending += p
            continue
        yield pending + body
        pending = p[len(body):]


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _blank(pieces: Iterator[str]) -> bool:
    """Reads every piece (so decoding errors surface); True if the text is only whitespace."""
    blank = True
    for p in pieces:
        if blank and p and not p.isspace():
            blank = False
    return blank


# --------------------------------------------------------------------------- text files

def _file_pieces(path: str, errors: str) -> Iterator[str]:
    dec = codecs.getincrementaldecoder("utf-8")(errors)
    first = True
    with open_input(path) as fh:
        while block := fh.read(limits.PIECE_BYTES):
            s = dec.decode(block)
            if first:
                s, first = s.removeprefix("\ufeff"), False  # a BOM is an encoding marker, not text
            yield s
    yield dec.decode(b"", final=True)


def long_text_file(path: str, name: str, tally) -> LongText | str:
    """A large .txt document in pieces ("" if it is only whitespace); invalid UTF-8 is repaired and counted."""
    try:
        blank = _blank(_file_pieces(path, "strict"))
        errors = "strict"
    except UnicodeDecodeError as e:
        tally.add("invalid_utf8_repaired", f"{name} (near byte {e.start})")
        errors = "replace"
        blank = _blank(_file_pieces(path, errors))
    return "" if blank else LongText(partial(_file_pieces, path, errors))


# --------------------------------------------------------------------------- JSON lines

def json_strings(line) -> Iterator[tuple[int, int]]:
    """(start, stop) of each JSON string token in line, quotes included, left to right.

    Found with bytes.find, not a regex: re's matcher keeps a backtracking record per repeat of an
    escape, so a 200 MB string full of escapes cost it 4x the line.  In JSON a quote outside a
    string opens one; inside, it closes it unless an odd run of backslashes comes before it.  An
    unterminated string ends the scan (the line then fails to parse)."""
    a = line.find(b'"')
    while a >= 0:
        q = a + 1
        while True:
            q = line.find(b'"', q)
            if q < 0:
                return
            k = q
            while line[k - 1] == 0x5C:  # never reaches a: line[a] is the opening quote
                k -= 1
            if (q - k) % 2 == 0:
                break
            q += 1
        yield a, q + 1
        a = line.find(b'"', q + 1)


def skeleton(line: bytes) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """The line with every string longer than limits.PIECE_BYTES replaced by a unique key, and
    where each such string's content lies in the line (quotes excluded)."""
    parts, spans, pos = [], {}, 0
    tag = uuid.uuid4().hex  # no document can contain it by chance
    for a, b in json_strings(line):
        if b - a > limits.PIECE_BYTES and not _COLON.match(line, b):  # a value, not an object key
            key = f"\x00helixtok-long:{tag}:{len(spans)}"
            parts += [line[pos:a], json.dumps(key).encode()]
            spans[key] = (a + 1, b - 1)
            pos = b
    parts.append(line[pos:])
    return b"".join(parts), spans


def _cut(line: bytes, start: int, stop: int) -> int:
    """End of the piece that starts at `start`: near start + limits.PIECE_BYTES, after a safe byte."""
    target = start + limits.PIECE_BYTES
    if target >= stop:
        return stop
    for q in range(target, start + limits.PIECE_BYTES // 2, -1):
        if line[q - 1] < 0x80 and line[q - 1] not in _UNSAFE_END:
            return q
    for q in range(target, stop):
        if line[q - 1] < 0x80 and line[q - 1] not in _UNSAFE_END:
            return q
    return stop


def _utf8_pieces(line: bytes, a: int, b: int, errors: str) -> Iterator[str]:
    view = memoryview(line)
    while a < b:
        q = _cut(line, a, b)
        yield str(view[a:q], "utf-8", errors)
        a = q


def _json_pieces(line: bytes, a: int, b: int, errors: str, repaired: list | None = None) -> Iterator[str]:
    for raw in _utf8_pieces(line, a, b, errors):
        s = json.loads('"' + raw + '"')
        if SURROGATE.search(s):  # pairs were joined by json (never cut apart): these are lone
            s = repair_surrogates(s)
            if repaired is not None:
                repaired.append(True)
        yield s


def parse_long_line(line: bytes, where: str, tally) -> tuple[object, Callable[[object], object]] | None:
    """Parse a long JSON line as a whole-line read would (same repairs and skips, counted the
    same way), holding no more than its bytes: (the object, `resolve`), or None if malformed.
    Long strings in the object are keys; `resolve(value)` turns one into its text: a LongText,
    or "" if it is only whitespace."""
    skel, spans = skeleton(line)
    errors = "strict"
    try:
        skel.decode("utf-8")
        for a, b in spans.values():
            for _ in _utf8_pieces(line, a, b, errors):
                pass
    except UnicodeDecodeError:
        tally.add("invalid_utf8_repaired", where)
        errors = "replace"
    repaired: dict[str, list] = {k: [] for k in spans}
    try:
        obj = json.loads(skel.decode("utf-8", errors))
        blank = {k: _blank(_json_pieces(line, a, b, errors, repaired[k])) for k, (a, b) in spans.items()}
    except ValueError as e:
        tally.add("malformed_json", f"{where} ({getattr(e, 'msg', e)})")
        return None
    except RecursionError:
        tally.add("malformed_json", f"{where} ({NESTED})")
        return None

    def resolve(value):
        if not isinstance(value, str) or value not in spans:
            return value
        if repaired[value]:
            tally.add("lone_surrogate_repaired", where)
        return "" if blank[value] else LongText(partial(_json_pieces, line, *spans[value], errors))

    return obj, resolve
