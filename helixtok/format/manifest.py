"""manifest.json: format version, atomic write, and a validating loader (spec: docs/format.md)."""

from __future__ import annotations

import bisect
import hashlib
import json
import os

import orjson

from .errors import DatasetError
from .objstore import is_url, redact, reports_storage_errors, watched_filesystem

FORMAT_VERSION = 5  # what build writes; 1 to 4 are still read (but a version 2 bestfit build: docs/format.md)
READABLE = (1, 2, 3, 4, 5)
MERGEABLE = (4, 5)  # parts merge is given: segment digests (4), chat masks (5)
MANIFEST = "manifest.json"
DTYPES = {"uint16": "<u2", "uint32": "<u4"}
# Reasons a document is skipped (counted in totals.skipped_documents) or repaired (still used).
DOC_SKIPS = ("empty", "malformed_json", "not_an_object", "missing_text", "null_text", "non_string_text",
             "not_a_conversation")
REPAIRS = ("invalid_utf8_repaired", "lone_surrogate_repaired")


def write_json_atomic(path: str, obj: dict, *, durable: bool = True) -> None:
    """Readers see the old file or the whole new one; durable: on disk before the rename.  Not
    durable (a journal entry, written per work unit): compact, by orjson."""
    tmp = os.path.join(os.path.dirname(path) or ".", "." + os.path.basename(path) + ".tmp")
    if not durable:
        with open(tmp, "wb") as fh:
            fh.write(orjson.dumps(obj))
        os.replace(tmp, path)
        return
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


@reports_storage_errors
def _read_remote(url: str) -> tuple[str, bytes]:
    fs, root = watched_filesystem(url)
    path = f"{redact(url).rstrip('/')}/{MANIFEST}"
    try:
        return path, fs.cat_file(f"{root.rstrip('/')}/{MANIFEST}")
    except FileNotFoundError:
        raise DatasetError(f"{redact(url)}: no {MANIFEST}; not a helixtok dataset (or its upload is unfinished: "
                           "rerun the same `helixtok build`)") from None


def load_manifest(out_dir: str) -> dict:
    """Load and check a finished dataset's manifest (a folder or a URL); refuse unfinished or unknown-version data."""
    if is_url(out_dir):
        path, raw = _read_remote(out_dir)
    else:
        path = os.path.join(out_dir, MANIFEST)
        if not os.path.isdir(out_dir):
            raise DatasetError(f"{out_dir}: no such dataset folder")
        if not os.path.isfile(path):
            hint = (" (the build is unfinished: rerun the same `helixtok build` to complete it)"
                    if os.path.isdir(os.path.join(out_dir, ".helixtok-partial")) else "")
            raise DatasetError(f"{out_dir}: no {MANIFEST}; not a helixtok dataset{hint}")
        with open(path, "rb") as fh:
            raw = fh.read()
    try:
        m = json.loads(raw)
    except ValueError as e:
        raise DatasetError(f"{path}: not valid JSON ({e}); rebuild the dataset") from e
    if not isinstance(m, dict):
        raise DatasetError(f"{path}: not a helixtok manifest (a JSON {type(m).__name__}); rebuild the dataset")
    v = m.get("format_version")
    if v not in READABLE:
        raise DatasetError(f"{path}: format_version {v!r}, this helixtok reads versions {min(READABLE)} to "
                           f"{max(READABLE)}; upgrade helixtok or rebuild the dataset")
    if v == 2 and m.get("packing") == "bestfit":
        raise DatasetError(f"{path}: a version 2 bestfit dataset (chunks packed within windows of one work unit); "
                           "this helixtok packs over the whole split: rebuild it with the same command and "
                           "--overwrite, or read it with helixtok 0.2")
    problems = schema_problems(m)
    if problems:
        raise DatasetError(f"{path}: invalid manifest; rebuild the dataset:\n" + "\n".join(f"  {p}" for p in problems))
    return m


SOURCE_COUNTS = ("documents", "tokens", "text_bytes")


def sum_sources(parts) -> dict:
    """The manifest's `sources` (documents, tokens and text bytes per source, sources.source_of,
    by name) summed over `parts`: units' journal entries, or parts' manifests, in that form."""
    total: dict[str, dict] = {}
    for part in parts:
        for src, c in part.items():
            acc = total.setdefault(src, dict.fromkeys(SOURCE_COUNTS, 0))
            for k in SOURCE_COUNTS:
                acc[k] += c[k]
    return dict(sorted(total.items()))


def manifest_files(m: dict) -> dict[str, dict]:
    """Every file a (validated) manifest names, relative path -> its entry (what Digest checks it by):
    tokenizer, shards, sidecars, indexes."""
    files = {m["tokenizer"]["file"]: {"sha256": m["tokenizer"]["sha256"]}}
    chat = m.get("chat")
    if isinstance(chat, dict) and isinstance(chat.get("template_file"), str):
        files[chat["template_file"]] = {"sha256": chat.get("template_sha256")}
    for s in m["splits"].values():
        for x in split_files(s):
            files[x["path"]] = x
    for x in (m.get("fields") or {}).get("files", ()):
        files[x["path"]] = x
    return files


def file_matches(path: str, x: dict) -> bool:
    """Whether the file at `path` holds what manifest (or journal) entry `x` says (Digest)."""
    h = Digest(x)
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
    return h.ok()


class Digest:
    """A file's bytes, fed in order, checked against its manifest entry: its "sha256", or (a version 4
    shard) its "segments", [bytes, sha256] each, back to back (docs/format.md)."""

    def __init__(self, x: dict):
        self._segs = [(int(n), sha) for n, sha in x["segments"]] if "segments" in x else None
        self._sha = x.get("sha256")
        self._h, self._i, self._in, self._ok = hashlib.sha256(), 0, 0, True

    def update(self, buf) -> None:
        buf = memoryview(buf).cast("B")
        if self._segs is None:
            self._h.update(buf)
            return
        while len(buf):
            self._close_full()
            if self._i == len(self._segs):  # more bytes than the segments hold
                self._ok = False
                return
            take = min(len(buf), self._segs[self._i][0] - self._in)
            self._h.update(buf[:take])
            self._in += take
            buf = buf[take:]

    def _close_full(self) -> None:
        while self._i < len(self._segs) and self._in == self._segs[self._i][0]:
            self._ok &= self._h.hexdigest() == self._segs[self._i][1]
            self._h, self._i, self._in = hashlib.sha256(), self._i + 1, 0

    def ok(self) -> bool:
        """Every byte fed: the file is what the entry says."""
        if self._segs is None:
            return self._h.hexdigest() == self._sha
        self._close_full()
        return self._ok and self._i == len(self._segs)


def split_files(s: dict):
    """Every file entry ({"path", "bytes", "sha256", ...}) of a split: its shards, their sidecars, its
    index.  Anything of a damaged manifest that is not an object is passed over (outdir reads OUT's
    manifest before it is validated)."""
    if not isinstance(s, dict):
        return
    shards = s.get("shards")
    for e in shards if isinstance(shards, list) else []:
        if not isinstance(e, dict):
            continue
        yield e
        for side in SIDE_NAMES:
            if isinstance(e.get(side), dict):
                yield e[side]
    index = s.get("index")
    for x in index.values() if isinstance(index, dict) else []:
        if isinstance(x, dict):
            yield x


def with_paths(s: dict, move) -> dict:
    """A split entry with every file path p replaced by move(p) (a merged or uploaded manifest's)."""
    s = {**s, "shards": [{**e, "path": move(e["path"]),
                          **{side: {**e[side], "path": move(e[side]["path"])} for side in SIDE_NAMES if side in e}}
                         for e in s["shards"]]}
    if "index" in s:
        s["index"] = {k: {**x, "path": move(x["path"])} for k, x in s["index"].items()}
    return s


# The sidecars each packing stores beside a shard (docs/format.md); bestfit also has a split index.
SIDES = {"packed": ("docs",), "document": ("valid",), "bestfit": ("docs",)}
# mask: a chat build's, one byte a token (1: it trains); src: where each document was read (packed,
# bestfit; a manifest with `unit_sources` has it, one written before it had not).
SIDE_NAMES = ("docs", "valid", "mask", "src")


def sides_of(m: dict) -> tuple[str, ...]:
    """The sidecars beside each shard of manifest m: its packing's, where each document was read
    (with `unit_sources`), and a chat build's mask."""
    src = ("src",) if m.get("unit_sources") is not None and m["packing"] != "document" and \
        m.get("format_version", 0) >= 5 else ()
    return SIDES[m["packing"]] + src + (("mask",) if m.get("chat") else ())
INDEX_FILES = ("items", "chunks")  # a bestfit split's index (bestfit.py)


def shard_tokens(e: dict, seq_len: int) -> int:
    """Tokens a shard holds: version 2 says so; a version 1 shard holds whole chunks."""
    return int(e["num_tokens"]) if "num_tokens" in e else int(e["num_chunks"]) * seq_len


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def schema_problems(m: dict) -> list[str]:
    """Every way `m` departs from the manifest schema of docs/format.md, one line each."""
    out: list[str] = []
    # A path stays inside the dataset's folder, or (a merged dataset) inside one of the parts it was merged from.
    roots = [os.path.normpath(r) for r in m.get("merged_from") or [] if isinstance(r, str)] if isinstance(m, dict) else []

    def inside(v) -> bool:
        if not _rel_path(v):
            return False
        p = os.path.normpath(v)
        return not p.startswith(os.pardir) or any(p.startswith(r + os.sep) for r in roots if r.startswith(os.pardir))

    def need(obj, key, check, what, where):
        if not isinstance(obj, dict) or key not in obj:
            out.append(f"{where}{key}: missing")
            return False
        if not check(obj[key]):
            out.append(f"{where}{key}: {obj[key]!r} is not {what}")
            return False
        return True

    need(m, "dtype", lambda v: v in DTYPES, "uint16 or uint32", "")
    need(m, "seq_len", lambda v: _int(v) and v > 0, "a positive integer", "")
    need(m, "packing", lambda v: v in SIDES, "packed, document or bestfit", "")
    if need(m, "tokenizer", lambda v: isinstance(v, dict), "an object", ""):
        t = m["tokenizer"]
        need(t, "sha256", lambda v: isinstance(v, str) and len(v) == 64, "a sha256 hex digest", "tokenizer.")
        for k in ("vocab_size", "eos_id", "pad_id"):
            need(t, k, _int, "a non-negative integer", "tokenizer.")
        need(t, "file", inside, "a relative path inside the dataset", "tokenizer.")
    if need(m, "totals", lambda v: isinstance(v, dict), "an object", ""):
        for k in ("documents", "tokens", "chunks"):
            need(m["totals"], k, _int, "a non-negative integer", "totals.")
    if "fields" in m and need(m, "fields", lambda v: isinstance(v, dict), "an object", ""):
        f = m["fields"]
        need(f, "names", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of names",
             "fields.")
        if need(f, "files", lambda v: isinstance(v, list), "a list", "fields."):
            for i, x in enumerate(f["files"]):
                need(x, "path", inside, "a relative path inside the dataset", f"fields.files[{i}].")
                need(x, "bytes", _int, "a non-negative integer", f"fields.files[{i}].")
                need(x, "sha256", lambda v: isinstance(v, str) and len(v) == 64, "a sha256 hex digest",
                     f"fields.files[{i}].")
            n = len(f["files"])
            need(f, "units", lambda v: isinstance(v, list) and all(
                u is None or (isinstance(u, list) and len(u) == 4 and _int(u[0]) and u[0] < n and _int(u[1])
                              and _int(u[2]) and isinstance(u[3], str) and len(u[3]) == 64) for u in v),
                 "a list of null or [file, offset, bytes, sha256]", "fields.")
    if not need(m, "splits", lambda v: isinstance(v, dict) and v, "a non-empty object", ""):
        return out
    for name, s in m["splits"].items():
        w = f"splits.{name}."
        if not isinstance(s, dict):
            out.append(f"splits.{name}: not an object")
            continue
        for k in ("num_chunks", "num_tokens", "documents", "tokens", "pad_tokens", "dropped_tokens"):
            need(s, k, _int, "a non-negative integer", w)
        if not need(s, "shards", lambda v: isinstance(v, list), "a list", w):
            continue
        for i, e in enumerate(s["shards"]):
            we = f"{w}shards[{i}]."
            if not isinstance(e, dict):
                out.append(f"{w}shards[{i}]: not an object")
                continue
            need(e, "path", inside, "a relative path inside the dataset", we)
            need(e, "num_tokens" if m.get("format_version") != 1 else "num_chunks", _int, "a non-negative integer", we)
            need(e, "bytes", _int, "a non-negative integer", we)
            if m.get("format_version", 0) >= 4:
                need(e, "segments", lambda v: _segments(v, e.get("bytes")), "a list of [bytes, sha256] that sum to "
                     "the shard's bytes", we)
            else:
                need(e, "sha256", lambda v: isinstance(v, str) and len(v) == 64, "a sha256 hex digest", we)
            for side in sides_of(m) if m.get("packing") in SIDES else ():
                if need(e, side, lambda v: isinstance(v, dict), "an object", we):
                    need(e[side], "path", inside, "a relative path inside the dataset", f"{we}{side}.")
                    need(e[side], "sha256", lambda v: isinstance(v, str) and len(v) == 64, "a sha256 hex digest",
                         f"{we}{side}.")
                    if side == "docs":
                        need(e[side], "count", _int, "a non-negative integer", f"{we}{side}.")
        if m.get("packing") == "bestfit" and need(s, "index", lambda v: isinstance(v, dict), "an object", w):
            for k in INDEX_FILES:
                wi = f"{w}index.{k}."
                if need(s["index"], k, lambda v: isinstance(v, dict), "an object", f"{w}index."):
                    need(s["index"][k], "path", inside, "a relative path inside the dataset", wi)
                    need(s["index"][k], "bytes", _int, "a non-negative integer", wi)
                    need(s["index"][k], "sha256", lambda v: isinstance(v, str) and len(v) == 64,
                         "a sha256 hex digest", wi)
    return out


def _segments(v, size) -> bool:
    return (isinstance(v, list) and all(isinstance(x, list) and len(x) == 2 and _int(x[0]) and isinstance(x[1], str)
                                        and len(x[1]) == 64 for x in v) and sum(x[0] for x in v) == size)


def _rel_path(v) -> bool:
    # Relative (a merged dataset may point into sibling part folders), never absolute.
    return isinstance(v, str) and bool(v) and not os.path.isabs(v)


def split_entry(m: dict, split: str, where: str) -> dict:
    if split not in m["splits"]:
        raise DatasetError(f"{where}: no split {split!r} (splits: {', '.join(m['splits'])})"
                           + ("; build with --val-fraction to get one" if split == "val" else ""))
    return m["splits"][split]


def read_seq_len(m: dict, s: dict, seq_len: int | None, where: str) -> tuple[int, int]:
    """(seq_len, chunks) a reader cuts split entry `s` into: the build's, or another `seq_len` for
    packed data -- its shards are one stream, cut every seq_len tokens from its start, so any
    length is exact (the stream's last partial chunk dropped, as the build drops its own) and a
    text build read at L is a build at L (a chat build's conversations longer than its own length
    stay dropped).  The other packings placed their chunks at the build's length: refused."""
    built = int(m["seq_len"])
    if seq_len is None or seq_len == built:
        return built, int(s["num_chunks"])
    if not isinstance(seq_len, int) or isinstance(seq_len, bool) or seq_len < 1:
        raise DatasetError(f"seq_len must be a positive whole number, got {seq_len!r}")
    if m["packing"] != "packed":
        raise DatasetError(f"{where}: a {m['packing']}-packed dataset holds chunks placed for seq_len {built}; "
                           f"reading it at {seq_len} needs a packed build (or build again with -L {seq_len})")
    stream = sum(shard_tokens(e, built) for e in s["shards"])
    return seq_len, stream // seq_len


def check_small_file(path: str, data, sha: str | None) -> None:
    """The small files that say where chunks and documents lie (a bestfit index, the .docs and .valid
    sidecars) are hashed as a reader first reads them: a damaged one would give wrong chunks or masks
    with no error.  (Shards are too large to hash on every open: helixtok verify does that.)"""
    if sha is not None and hashlib.sha256(data).hexdigest() != sha:
        raise DatasetError(f"{path}: its sha256 is not the manifest's (damaged or changed since the build); "
                           "copy the dataset again or rebuild it (helixtok verify says more)")


class DocumentSources:
    """Where each document of a split was read (docs/format.md, "Where documents came from"): its work
    unit from `unit_documents`, what the unit read from `unit_sources`, and its place in the unit from
    its .src entry.  None for a dataset written without them."""

    def __init__(self, m: dict, split: str):
        units, counts = m.get("unit_sources"), (m.get("unit_documents") or {}).get(split)
        self.known = units is not None and counts is not None and len(units) == len(counts)
        self.units, self.ends, first, lines = units or [], [], [], {}
        at = 0
        for n in counts or []:
            at += n
            self.ends.append(at)
        for e in self.units:  # a line range whose first line the plan did not know follows the ranges before it
            if e[0] == "line":
                first.append(e[2] or lines.get(e[1], 0) + 1)
                lines[e[1]] = (e[2] or lines.get(e[1], 0) + 1) - 1 + e[3]
            else:
                first.append(None)
        self.first = first

    def unit_of(self, doc: int) -> int | None:
        """The work unit document `doc` of the split (in stream order) was read in; None if unknown."""
        u = bisect.bisect_right(self.ends, doc) if self.known else len(self.units)
        return u if u < len(self.units) else None

    def __call__(self, doc: int, k: int) -> str | None:
        """Document `doc` of the split (in stream order), whose .src entry is k."""
        u = self.unit_of(doc)
        if u is None:
            return None
        e = self.units[u]
        if e[0] == "file":
            return e[1][k] if k < len(e[1]) else None
        if e[0] == "element":
            return f"{e[1]} element {k + 1}"
        if e[0] == "row":
            return f"{e[1]} row {e[2] + k}"
        return f"{e[1]}:{self.first[u] + k}"
