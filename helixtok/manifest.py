"""manifest.json: format version, atomic write, and a validating loader (spec: docs/format.md)."""

from __future__ import annotations

import json
import os

from .errors import DatasetError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DTYPES = {"uint16": "<u2", "uint32": "<u4"}
# Reasons a document is skipped (counted in totals.skipped_documents) or repaired (still used).
DOC_SKIPS = ("empty", "malformed_json", "not_an_object", "missing_text", "null_text", "non_string_text")
REPAIRS = ("invalid_utf8_repaired", "lone_surrogate_repaired")


def write_json_atomic(path: str, obj: dict) -> None:
    tmp = os.path.join(os.path.dirname(path) or ".", "." + os.path.basename(path) + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=2, sort_keys=False)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_manifest(out_dir: str) -> dict:
    """Load and check a finished dataset's manifest; refuse unfinished or unknown-version data."""
    path = os.path.join(out_dir, MANIFEST)
    if not os.path.isdir(out_dir):
        raise DatasetError(f"{out_dir}: no such dataset folder")
    if not os.path.isfile(path):
        hint = (" (the build is unfinished: rerun the same `helixtok build` to complete it)"
                if os.path.isdir(os.path.join(out_dir, ".helixtok-partial")) else "")
        raise DatasetError(f"{out_dir}: no {MANIFEST}; not a helixtok dataset{hint}")
    try:
        with open(path) as fh:
            m = json.load(fh)
    except ValueError as e:
        raise DatasetError(f"{path}: not valid JSON ({e}); rebuild the dataset") from e
    v = m.get("format_version")
    if v != FORMAT_VERSION:
        raise DatasetError(f"{path}: format_version {v!r}, this helixtok reads version {FORMAT_VERSION}; "
                           "upgrade helixtok or rebuild the dataset")
    for key in ("dtype", "seq_len", "packing", "tokenizer", "splits", "totals"):
        if key not in m:
            raise DatasetError(f"{path}: missing key {key!r}; rebuild the dataset")
    if m["dtype"] not in DTYPES:
        raise DatasetError(f"{path}: unknown dtype {m['dtype']!r} (expected uint16 or uint32)")
    return m


def split_entry(m: dict, split: str, where: str) -> dict:
    if split not in m["splits"]:
        raise DatasetError(f"{where}: no split {split!r} (splits: {', '.join(m['splits'])})"
                           + ("; build with --val-fraction to get one" if split == "val" else ""))
    return m["splits"][split]
