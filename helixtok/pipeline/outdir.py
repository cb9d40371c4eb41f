"""The output folder: one build at a time (a lock), publishing into it (manifest last), and removal of only the files helixtok wrote there."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import time

from ..format.errors import ConfigError
from ..format.manifest import MANIFEST, SIDE_NAMES, split_files, write_json_atomic
from ..format.planid import PLAN_FILE
from .journal import PUBLISHED, journaled_shards

STATE = ".helixtok-partial"  # everything an unfinished build keeps; only helixtok writes inside
LOCK_INFO = ".helixtok-lock"  # who holds the lock, for the message a second build prints
OWNED = "owned.json"  # in STATE: files of an earlier dataset being removed by --overwrite
PUBLISH = "publish.json"  # in STATE: files being moved from STATE into OUT by the final step


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_out_path(out: str) -> None:
    """OUT is a folder, or nothing yet: not a file, not a link to nowhere (said as such, not "File exists")."""
    if os.path.islink(out) and not os.path.exists(out):
        raise ConfigError(f"{out}: a symbolic link to {os.readlink(out)!r}, which does not exist; create that "
                          "folder or remove the link")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"{out}: exists and is not a folder")


class OutLock:
    """An exclusive flock on the OUT folder itself, held for a whole build or merge.

    The kernel drops it when the holder dies (kill -9 included), so it is never stale; a
    second build fails at once naming the holder.  Worker processes do not inherit it.
    """

    def __init__(self, out: str):
        self.out = out
        self.fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise ConfigError(f"{out}: another helixtok process ({_holder(out)}) is writing this folder; "
                              "wait for it to finish or stop it, then rerun") from None
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open(os.path.join(out, LOCK_INFO), "w") as fh:  # only informative: no need to be atomic
            json.dump(info, fh)

    def release(self) -> None:
        if self.fd >= 0:
            try:
                os.remove(os.path.join(self.out, LOCK_INFO))
            except FileNotFoundError:
                pass
            os.close(self.fd)  # closing the descriptor drops the flock
            self.fd = -1

    def __enter__(self) -> "OutLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _holder(out: str) -> str:
    try:
        with open(os.path.join(out, LOCK_INFO)) as fh:
            h = json.load(fh)
        return f"pid {h['pid']} on {h['host']}, since {h['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "pid unknown"


def read_list(path: str) -> list[str]:
    """The names a STATE record (owned.json, publish.json) lists; none if it is missing or damaged."""
    try:
        with open(path) as fh:
            v = json.load(fh)
    except (OSError, ValueError):
        return []
    return [x for x in v.get("files", []) if isinstance(x, str)] if isinstance(v, dict) else []


def _manifest_files(out: str) -> list[str]:
    """Top-level names a finished dataset's manifest says are its own (best effort on a damaged one)."""
    try:
        with open(os.path.join(out, MANIFEST)) as fh:
            m = json.load(fh)
    except (OSError, ValueError):
        return []
    if not isinstance(m, dict):
        return []
    names = [MANIFEST]
    tok = m.get("tokenizer")
    if isinstance(tok, dict) and isinstance(tok.get("file"), str):
        names.append(tok["file"])
    if not m.get("merged_from"):
        names.append(PLAN_FILE)  # what the build was built from (planid.py), beside its manifest
    # A merged dataset's parts: the folders in OUT it was joined from are part of it.
    merged = m.get("merged_from")
    names += [p for p in merged if isinstance(p, str)] if isinstance(merged, list) else []
    splits = m.get("splits")
    for s in splits.values() if isinstance(splits, dict) else []:
        for p in (x.get("path") for x in split_files(s)):
            if isinstance(p, str):  # only files directly in OUT (a merged dataset's are in its parts)
                names.append(p)
    return [n for n in names if os.sep not in n and n not in ("", ".", "..")]


def owned_entries(out: str) -> set[str]:
    """Names in OUT that helixtok wrote: the manifest's files, STATE's records, STATE and the lock info."""
    state = os.path.join(out, STATE)
    names = {STATE, LOCK_INFO, *_manifest_files(out)}
    names.update(read_list(os.path.join(state, OWNED)))
    names.update(read_list(os.path.join(state, PUBLISH)))
    if os.path.isfile(os.path.join(state, "plan.json")):  # an unfinished build: its journal vouches too
        for b in journaled_shards(state):
            names.update([b, *(b.removesuffix(".bin") + "." + side for side in SIDE_NAMES)])
        names.update(PUBLISHED)
    return names | {f".{n}.tmp" for n in names}  # write_json_atomic's and the shard writer's temp names


def foreign_entries(out: str) -> list[str]:
    owned = owned_entries(out)
    return sorted(e for e in os.listdir(out) if e not in owned)


def refuse_foreign_state(out: str) -> None:
    """A `.helixtok-partial/` helixtok did not write (no record of a build in it) is left alone."""
    state = os.path.join(out, STATE)
    if not os.path.isdir(state) or os.path.islink(state):
        if os.path.lexists(state) and not os.path.isdir(state):
            raise ConfigError(f"{state}: is not a folder helixtok wrote; move it away")
        return
    if os.path.isfile(os.path.join(state, "plan.json")):
        return
    foreign = sorted(n for n in os.listdir(state) if not _STATE_NAMES.fullmatch(n))
    if foreign:
        raise ConfigError(f"{state}: holds {foreign[0]!r}, and no record of a helixtok build (plan.json); "
                          "helixtok did not write it: move it away (helixtok never deletes files it did not write)")


# What helixtok writes in STATE (and their temp names): a folder holding only these is its own.
_STATE_NAMES = re.compile(r"\.?(u\d{6}\.\S+|g\d{6}\.\S+|plan\.json|owned\.json|publish\.json|tokenizer\.json|"
                          r"build-plan\.json|manifest\.json|ray-driver\.log|chat_template\.jinja|(?:train|val)\.(?:items|chunks))(\.tmp)?")


def refuse_foreign(out: str, allowed: set[str] = frozenset()) -> None:
    foreign = [e for e in foreign_entries(out) if e not in allowed]
    if foreign:
        more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
        raise ConfigError(f"{out}: holds {foreign[0]!r}{more}, which helixtok did not write; build into an "
                          "empty or new folder (helixtok never deletes files it did not write)")


def remove_owned(out: str, keep: set[str] | None = None, protect: list[str] = ()) -> None:
    """Delete a previous dataset or unfinished build in OUT: only files helixtok wrote, never an input.

    The list of what is being deleted is written into STATE first, so a kill halfway leaves
    the rest still known as helixtok's.
    """
    state = os.path.join(out, STATE)
    victims = sorted(e for e in owned_entries(out) if e not in (STATE, LOCK_INFO) and e not in (keep or ())
                     and os.path.lexists(os.path.join(out, e)))
    protected = {os.path.realpath(p) for p in protect}
    for v in victims:
        if os.path.realpath(os.path.join(out, v)) in protected:
            raise ConfigError(f"{os.path.join(out, v)}: is one of this build's inputs and would be deleted by "
                              "--overwrite; copy it out of the folder first")
    if victims:
        os.makedirs(state, exist_ok=True)
        write_json_atomic(os.path.join(state, OWNED), {"files": victims})
    # The manifest goes first: from then on the folder no longer claims to hold a dataset.
    for v in sorted(victims, key=lambda v: v != MANIFEST):
        p = os.path.join(out, v)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)
    if os.path.isdir(state):
        shutil.rmtree(state)


def unpublish(out: str) -> None:
    """A build stopped while publishing: what it moved into OUT goes back to its name in STATE,
    where the resumed build checks it (a group's shard is trusted by its units' segments) and
    publishes it again."""
    state = os.path.join(out, STATE)
    try:
        with open(os.path.join(state, PUBLISH)) as fh:
            moves = json.load(fh).get("moves", [])
    except (OSError, ValueError, AttributeError):
        moves = []
    # Its journal names the shards too (publish.json lost or damaged: they are not left in OUT).
    moves = [*(moves if isinstance(moves, list) else []), *([n, p] for p, n in journaled_shards(state).items())]
    for m in moves:
        if not (isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) and x and os.path.basename(x) == x
                                                             for x in m)):
            continue
        n, p = m
        if os.path.isfile(os.path.join(out, p)) and not os.path.exists(os.path.join(state, n)):
            os.replace(os.path.join(out, p), os.path.join(state, n))


def publish(out: str, moves: list[tuple[str, str]], manifest: dict) -> None:
    """Move a build's files (name in STATE, name in OUT) into OUT, then write the manifest, last
    and atomically, and remove STATE.

    publish.json names the files first, so a kill halfway leaves them known as helixtok's (a
    rerun finds the moved shards there and publishes again; --overwrite removes them).
    """
    state = os.path.join(out, STATE)
    write_json_atomic(os.path.join(state, PUBLISH), {"files": [p for _, p in moves], "moves": moves})
    for n, p in moves:
        if os.path.exists(os.path.join(state, n)):  # else moved by a build stopped while publishing
            os.replace(os.path.join(state, n), os.path.join(out, p))
    fsync_dir(out)  # shard renames are durable before the manifest says they exist
    write_json_atomic(os.path.join(state, MANIFEST), manifest)
    os.replace(os.path.join(state, MANIFEST), os.path.join(out, MANIFEST))
    fsync_dir(out)
    shutil.rmtree(state)
