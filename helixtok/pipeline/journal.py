"""A build's journal in its state folder (.helixtok-partial/): an entry per finished unit and per
placement, and the files each names: what a resume trusts and a publish moves."""

from __future__ import annotations

import os

from ..format.manifest import SIDE_NAMES


def done_path(state: str, index: int) -> str:
    return os.path.join(state, f"u{index:06d}.done.json")


def placed_path(state: str, index: int) -> str:
    return os.path.join(state, f"u{index:06d}.placed.json")


def state_files(result: dict, with_sha: bool = False):
    """(name in STATE, name once published, bytes[, sha256]) of every file a unit's journal entry names."""
    for entries in result["shards"].values():
        for e in entries:
            for x in (e, *(e[side] for side in SIDE_NAMES if side in e)):
                yield (x["state"], x["path"], x["bytes"]) + ((x["sha256"],) if with_sha else ())
