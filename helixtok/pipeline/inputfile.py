"""InputFile: one corpus file as discovery found it (where, its name in the manifest, kind, size, stamp)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class InputFile:
    path: str  # as found (a local path or a URL), used to open the file and in error messages
    name: str  # relative to the common root of all inputs: what the manifest records
    kind: str
    size: int
    stamp: str  # changes when the content does: see objstore.local_stamp; an object's ETag (or the like)
