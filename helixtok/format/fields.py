"""Kept fields (--keep-fields): each record's small fields in a JSON lines file, a line per work unit, found through the manifest."""

from __future__ import annotations

import hashlib
import json
import os

from .errors import DatasetError

FIELDS_FILE = "fields.jsonl"
UNITS_KEPT = 16  # units' lines a reader keeps parsed (a shuffled walk touches many; each is ~1 MB at most)


def unit_line(fields: dict[str, dict]) -> bytes:
    """A work unit's line: {"<place in the unit>": {field: value}} in place order, compact, each record's
    fields in --keep-fields' order (docs/format.md, "Kept fields"): the same fields give the same bytes."""
    ordered = {k: fields[k] for k in sorted(fields, key=int)}
    return json.dumps(ordered, ensure_ascii=False, sort_keys=False, separators=(",", ":"),
                      default=str).encode() + b"\n"


def write_fields(folder: str, names: tuple[str, ...], per_unit: list[dict | None]) -> dict | None:
    """FIELDS_FILE in `folder` from each unit's kept fields (None or {} where it kept none), and the
    manifest's "fields" entry for it; None when no unit kept any (no file)."""
    if not names or not any(per_unit):
        return None
    units, at = [], 0
    h = hashlib.sha256()
    with open(os.path.join(folder, FIELDS_FILE), "wb") as fh:
        for f in per_unit:
            if not f:
                units.append(None)
                continue
            line = unit_line(f)
            fh.write(line)
            h.update(line)
            units.append([0, at, len(line), hashlib.sha256(line).hexdigest()])
            at += len(line)
        fh.flush()
        os.fsync(fh.fileno())
    return {"names": list(names), "files": [{"path": FIELDS_FILE, "bytes": at, "sha256": h.hexdigest()}],
            "units": units}


def merged_fields(entries: list[dict | None], units_per_part: list[int], move) -> dict | None:
    """The "fields" entry of a merge of parts (their entries, None where a part kept none; their
    unit counts; move(part index, path) -> the path from the merged folder)."""
    if not any(entries):
        return None
    files, units, names = [], [], []
    for i, (e, n) in enumerate(zip(entries, units_per_part)):
        if not e:
            units += [None] * n
            continue
        base = len(files)
        files += [{**x, "path": move(i, x["path"])} for x in e["files"]]
        units += [None if u is None else [u[0] + base, *u[1:]] for u in e["units"]]
        names += [n for n in e["names"] if n not in names]
    return {"names": names, "files": files, "units": units}


def moved_fields(entry: dict, move) -> dict:
    """The entry with each file path p named move(p)."""
    return {**entry, "files": [{**x, "path": move(x["path"])} for x in entry["files"]]}


class DocumentFields:
    """The kept fields of the records of a dataset's work units: (unit, place k in it: a document's
    .src entry) -> its fields, or None.  `read(path, offset, length)` reads a dataset file's bytes
    (local or in object storage); a unit's line is read when first asked for, checked against its
    sha256, and kept while it is among the UNITS_KEPT used last."""

    def __init__(self, m: dict, read):
        e = m.get("fields")
        # Aligned with unit_sources (one entry a unit, whatever the split), or unknown.
        self.known = isinstance(e, dict) and len(e.get("units", ())) == len(m.get("unit_sources") or ())
        self._e, self._read, self._lines = e, read, {}

    def __call__(self, u: int | None, k: int) -> dict | None:
        if not self.known or u is None or self._e["units"][u] is None:
            return None
        line = self._lines.pop(u, None)
        if line is None:
            f, off, n, sha = self._e["units"][u]
            path = self._e["files"][f]["path"]
            data = self._read(path, off, n)
            if len(data) != n or hashlib.sha256(data).hexdigest() != sha:
                raise DatasetError(f"{path}: bytes {off}-{off + n} are not what the manifest says (damaged or changed "
                                   "since the build); copy the dataset again or rebuild it (helixtok verify says more)")
            line = json.loads(data)
            if len(self._lines) >= UNITS_KEPT:  # the least recently used goes: memory stays flat
                self._lines.pop(next(iter(self._lines)))
        self._lines[u] = line  # (last in the dict: the most recently used)
        return line.get(str(k))
