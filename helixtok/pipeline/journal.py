"""A build's journal in its state folder (.helixtok-partial/): an entry per finished unit and per
placement, and the files each names: what a resume trusts and a publish moves."""

from __future__ import annotations

import hashlib
import json
import os

from ..format.bestfit import index_files
from ..format.manifest import SIDE_NAMES, write_json_atomic

DIGEST = "entry_sha256"  # each entry's digest of itself: an entry edited or damaged since is not trusted


def done_path(state: str, index: int) -> str:
    return os.path.join(state, f"u{index:06d}.done.json")


def placed_path(state: str, index: int) -> str:
    return os.path.join(state, f"u{index:06d}.placed.json")


def piece_name(g: int, split: str, k: int) -> str:
    """A shard's name in STATE while its group is placed.  Not named for the run: a resumed build
    places its remaining units into the pieces the interrupted one left (their trusted segments
    re-hashed first, resume.py); every writer writes the same bytes at the same offsets."""
    return f"g{g:06d}.{split}.{k:04d}.bin"


def shard_stem(g: int, split: str, k: int) -> str:
    """The published name of group g's k-th shard of `split`, less its extension (.bin and sidecars)."""
    return f"{split}-{g:06d}-{k:04d}"


# What a build publishes besides its shards: its copies of the tokenizer (and chat template), its
# plan, a bestfit split's index (format/manifest.py names them too).
PUBLISHED = ("tokenizer.json", "chat_template.jinja", "build-plan.json",
             *(n for s in ("train", "val") for n in index_files(s).values()))


def journaled_shards(state: str) -> dict[str, str]:
    """Published name -> name in STATE of each group shard the journal's placements name: what a
    build stopped while publishing may have moved into OUT, known (and moved back) even when the
    record of the moves (publish.json) was lost."""
    out = {}
    for n in os.listdir(state):
        if n.endswith(".placed.json") and (p := read_entry(os.path.join(state, n))) is not None:
            try:
                for s, segs in p["segments"].items():
                    for k, *_ in segs:
                        out[f"{shard_stem(p['group'], s, k)}.bin"] = piece_name(p["group"], s, k)
            except (KeyError, TypeError, ValueError, AttributeError):
                continue
    return out


def state_files(result: dict, with_sha: bool = False):
    """(name in STATE, name once published, bytes[, sha256]) of every file a unit's journal entry names."""
    for entries in result["shards"].values():
        for e in entries:
            for x in (e, *(e[side] for side in SIDE_NAMES if side in e)):
                yield (x["state"], x["path"], x["bytes"]) + ((x["sha256"],) if with_sha else ())


def _digest(entry: dict) -> str:
    body = {k: v for k, v in entry.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_entry(path: str, entry: dict) -> None:
    """A journal entry, with its digest of itself (DIGEST): written once, by the process that did the
    work (not fsynced: a resume after a power loss finds it whole and matching, or redoes it)."""
    write_json_atomic(path, {**entry, DIGEST: _digest(entry)}, durable=False)


def read_entry(path: str) -> dict | None:
    """The journal entry at `path` (without its digest), or None: missing, unreadable, or not the
    bytes that were written (valid JSON edited or bit-flipped since: its digest differs), so its
    unit is done again rather than its numbers published."""
    try:
        with open(path, "rb") as fh:
            entry = json.loads(fh.read())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get(DIGEST) != _digest(entry):
        return None
    del entry[DIGEST]
    return entry
