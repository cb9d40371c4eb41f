"""What OUT already holds: this very build, finished (up to date); an unfinished one to resume, and
the finished units it can trust; or something to refuse, named."""

from __future__ import annotations

import contextlib
import json
import os
import shutil

from ..format.errors import ConfigError
from ..format.manifest import file_matches, load_manifest, manifest_files, split_files
from ..format.planid import PLAN_FILE, describe_change
from .journal import done_path, piece_name, placed_path, read_entry, state_files
from .outdir import STATE, refuse_foreign, refuse_foreign_state, remove_owned, unpublish
from .units import Unit


def up_to_date(out: str, plan: bytes) -> dict:
    """The finished dataset in OUT, when it was built from this very plan and its files are all
    there with their sizes (a Slurm requeue, a Ray retry of a finished task); else why not, as
    the refusal to build over it."""
    m = load_manifest(out)  # checked: a damaged manifest is refused, never called up to date
    try:
        with open(os.path.join(out, PLAN_FILE), "rb") as fh:
            theirs = fh.read()
    except FileNotFoundError:  # built by an older helixtok: nothing tells what it was built from
        raise ConfigError(f"{out}: already holds a finished dataset; pass --overwrite to replace it") from None
    if theirs != plan:
        try:
            change = describe_change(json.loads(theirs), json.loads(plan))
        except ValueError:
            change = f"its {PLAN_FILE} is unreadable"
        raise ConfigError(f"{out}: already holds a finished dataset built from other inputs or options ({change}); "
                          "pass --overwrite to replace it")
    sizes = {x["path"]: x["bytes"] for sp in m["splits"].values() for x in split_files(sp) if "bytes" in x}
    for rel in manifest_files(m):
        p = os.path.join(out, rel)
        if not (os.path.isfile(p) and (rel not in sizes or os.path.getsize(p) == sizes[rel])):
            raise ConfigError(f"{out}: holds this build's manifest but {rel} is missing or has another size; "
                              "pass --overwrite to build it again")
    shutil.rmtree(os.path.join(out, STATE), ignore_errors=True)  # an interrupted last step (cleanup)
    return m


def prepare_out(out: str, plan: dict, overwrite: bool, protect: list[str]) -> bool:
    """Make the locked OUT ready; returns True when an unfinished build with the same plan can resume.
    (A finished dataset without --overwrite never gets here: up_to_date says what it is.)"""
    state = os.path.join(out, STATE)
    refuse_foreign(out)
    refuse_foreign_state(out)
    if overwrite:
        remove_owned(out, protect=protect)
        return False
    plan_path = os.path.join(state, "plan.json")
    if os.path.isfile(plan_path):
        try:
            with open(plan_path) as fh:
                old = json.load(fh)
        except ValueError:
            old = None
        if old == plan:
            unpublish(out)
            return True
        if old is not None:
            raise ConfigError(f"{out}: holds an unfinished build with other inputs or options "
                              f"({describe_change(old, plan)}); pass --overwrite to discard it")
    # Leftovers that no plan describes (a kill before plan.json was written) are ours and useless.
    remove_owned(out)
    return False


def trusted_results(out: str, state: str, units: list[Unit], groups: list[tuple[int, int, int]],
                    uploaded: dict[str, int] | None = None) -> tuple[dict[int, dict], dict[int, dict]]:
    """Journal entries of finished units that are still good, and the placements of those already in
    their group's shards: a unit is good when its files are all there with the sizes and sha256 its
    worker recorded as it wrote them -- or, once placed (its .bin deleted), when every segment its
    placement records still hashes to its digest in the group's shard and its sidecars are good.
    Object storage (uploaded: object name -> size): each file uploaded with its size (the upload was
    checked).  Everything is read again: a file replaced by other bytes of the same size (a damaged
    disk, a copy from another run) is not trusted, and its unit is tokenized again -- reading costs
    a fraction of tokenizing.

    Read once, at start: the lock guarantees no other build writes here.  Files nothing trusted
    names are deleted; so are the groups' sidecars (each group is closed again).
    """
    from .join import load_placed, placed_from, segments_hold

    group = {i: g for g, a, b in groups for i in range(a, b)}
    trusted: dict[int, dict] = {}
    placed: dict[int, dict] = {}
    for u in units:
        try:
            r = read_entry(done_path(state, u.index))
            if r is None or not (r["index"] == u.index and "lines" in r and "sources" in r and "counts" in r):
                continue
            files = list(state_files(r, with_sha=True))
            if uploaded is not None:
                ok = all(uploaded.get(p) == size for _, p, size, _ in files)
            elif all(_has(os.path.join(state, n), size, sha) for n, _, size, sha in files):
                ok = True
            else:  # placed: its ids are in the group's shards, its sidecars still here
                p = load_placed(state, u.index)
                ok = (p is not None and p.get("group") == group.get(u.index) and p.get("from") == placed_from(r)
                      and all(_has(os.path.join(state, n), size, sha) for n, _, size, sha in files
                              if not n.endswith(".bin"))
                      and all(segments_hold(os.path.join(state, piece_name(p["group"], s, k)), ranges)
                              for (s, k), ranges in _by_piece(p).items()))
                if ok:
                    placed[u.index] = p
        except (OSError, ValueError, KeyError, TypeError):
            ok = False
        if ok:
            trusted[u.index] = r
    keep = {n for r in trusted.values() for n, _, _ in state_files(r)}
    keep |= {os.path.basename(placed_path(state, i)) for i in placed}
    keep |= {piece_name(p["group"], s, k) for p in placed.values() for s, segs in p["segments"].items()
             for k, *_ in segs}
    for e in os.listdir(state):  # files of units not finished or not good, the groups' sidecars
        if (e.startswith("g") or e.startswith("u")) and e not in keep and not e.endswith(".done.json"):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(state, e))
    return trusted, placed


def _by_piece(p: dict) -> dict:
    """A placement's segments, (split, piece) -> [(byte offset, bytes, sha256)]: each piece opened once."""
    out: dict = {}
    for s, segs in p["segments"].items():
        for k, off, n, sha in segs:
            out.setdefault((s, k), []).append((off, n, sha))
    return out


def _has(path: str, size: int, sha: str) -> bool:
    if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) != size:
        return False
    return file_matches(path, {"sha256": sha})
