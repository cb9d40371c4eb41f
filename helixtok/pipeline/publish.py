"""Datasets in object storage: publish a finished build (files first, manifest last) and pull one to local disk.

A remote dataset is `URL/manifest.json` plus a folder `URL/data-<digest>/` holding the files it
names, where the digest is that of the local manifest: the same inputs and options give the same
keys and bytes.  A PUT of one object is atomic, so a reader sees the old manifest or the new one,
each naming only files that were uploaded before it; a build that dies, or a second build into the
same URL, can never make a manifest point at missing or foreign bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import posixpath
import re
import tempfile
from concurrent.futures import ThreadPoolExecutor

from ..format.errors import ConfigError, DatasetError
from ..format.fields import moved_fields
from ..format.manifest import (MANIFEST, SIDE_NAMES, Digest, file_matches, load_manifest, manifest_files, with_paths,
                               write_json_atomic)
from ..format.objstore import redact, reports_storage_errors, watched_filesystem
from ..format.planid import PLAN_FILE, plan_folder
from .outdir import OutLock, fsync_dir

UPLOAD_THREADS = 4  # objects in flight; each large one is itself a multipart upload
COPY_BLOCK = 8 << 20


def staging_dir(url: str, staging: str | None) -> str:
    """Where a build for `url` runs first: --staging, else a folder under the temp dir named for
    the URL, so rerunning the same command resumes an interrupted build."""
    if staging:
        return staging
    tag = hashlib.sha256(redact(url).encode()).hexdigest()[:16]
    return os.path.join(os.environ.get("HELIXTOK_STAGING") or tempfile.gettempdir(), f"helixtok-staging-{tag}")


def _remote_manifest(fs, root: str, url: str) -> dict | None:
    try:
        raw = fs.cat_file(posixpath.join(root, MANIFEST))
    except FileNotFoundError:
        return None
    try:
        m = json.loads(raw)
    except ValueError:
        m = None
    if not isinstance(m, dict) or "format_version" not in m or "splits" not in m:
        raise ConfigError(f"{redact(url)}/{MANIFEST}: exists and is not a helixtok manifest; choose another URL "
                          "(helixtok never replaces files it did not write)")
    return m


@reports_storage_errors
def check_target(url: str, overwrite: bool, stall: float = 600.0) -> None:
    """Before any work: refuse a URL that already holds a dataset (without --overwrite) or a foreign manifest."""
    fs, root = watched_filesystem(url, stall)
    if _remote_manifest(fs, root, url) is not None and not overwrite:
        raise ConfigError(f"{redact(url)}: already holds a finished dataset; pass --overwrite to replace it")
    probe = posixpath.join(root, ".helixtok-write-check")  # a missing bucket or no write access fails now, not
    fs.pipe_file(probe, b"")                                # after hours of tokenizing
    fs.rm_file(probe)


@reports_storage_errors
def upload(local: str, url: str, *, overwrite: bool, stall: float = 600.0) -> dict:
    """Upload the finished dataset in `local` to `url`, the manifest last; returns the remote manifest.
    A storage call that shows no life for `stall` s fails the upload (the manifest is never written)."""
    m = load_manifest(local)
    with open(os.path.join(local, MANIFEST), "rb") as fh:
        folder = "data-" + hashlib.sha256(fh.read()).hexdigest()[:16]
    paths = list(manifest_files(m))
    if any(p.startswith("..") or os.path.isabs(p) for p in map(os.path.normpath, paths)):
        raise ConfigError(f"{local}: names files outside its folder (a merge of parts elsewhere); "
                          "merge into one folder first")
    fs, root = watched_filesystem(url, stall)
    old = _remote_manifest(fs, root, url)
    if old is not None and not overwrite:
        raise ConfigError(f"{redact(url)}: already holds a finished dataset; pass --overwrite to replace it")
    base = posixpath.join(root, folder)
    ours = {posixpath.join(base, p) for p in paths}
    try:
        there = set(fs.find(base))
    except FileNotFoundError:
        there = set()
    foreign = sorted(there - ours)
    if foreign:
        raise ConfigError(f"{redact(url)}: {fs.unstrip_protocol(foreign[0])} was not written by this build; "
                          "remove it or choose another URL")

    def put(p: str) -> None:
        src, dst = os.path.join(local, p), posixpath.join(base, p)
        fs.put_file(src, dst)  # multipart above the driver's part size (s3fs: 50 MiB)
        fs.invalidate_cache(dst)
        got, sent = fs.info(dst)["size"], os.path.getsize(src)
        if got != sent:
            raise DatasetError(f"{redact(url)}: {p} has {got} bytes after upload, {sent} were sent; "
                               "rerun the same command")

    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        list(pool.map(put, sorted(paths, key=lambda p: -os.path.getsize(os.path.join(local, p)))))
    remote = _prefixed(m, folder)
    fs.pipe_file(posixpath.join(root, MANIFEST), (json.dumps(remote, indent=2) + "\n").encode())
    if old is not None:
        _remove_replaced(fs, root, url, old)
    return remote


def remote_sizes(url: str, folder: str, stall: float = 600.0) -> dict[str, int]:
    """Object name -> size of what is under URL/folder (one listing): a resumed Ray build's check."""
    fs, root = watched_filesystem(url, stall)
    base = posixpath.join(root, folder)
    try:
        found = fs.find(base, detail=True)
    except FileNotFoundError:
        return {}
    return {posixpath.relpath(k, base): int(v["size"]) for k, v in found.items()}


def remote_bytes(url: str, folder: str, path: str, stall: float = 600.0, start: int | None = None,
                 end: int | None = None) -> bytes:
    """One object under URL/folder (a Ray task's upload), or bytes [start, end) of it: what the driver
    reads of it, a .docs sidecar, a .mask's last bytes."""
    fs, root = watched_filesystem(url, stall)
    return fs.cat_file(posixpath.join(root, folder, path), start=start, end=end)


def upload_unit(state: str, files, url: str, folder: str, stall: float) -> None:
    """On a Ray task's node: its unit's shards (state name, final name, bytes) from its own staging
    folder into URL/folder, each checked for its size."""
    fs, root = watched_filesystem(url, stall)
    for n, p, size in files:
        dst = posixpath.join(root, folder, p)
        fs.put_file(os.path.join(state, n), dst)
        fs.invalidate_cache(dst)
        if fs.info(dst)["size"] != size:
            raise DatasetError(f"{redact(url)}: {p} has {fs.info(dst)['size']} bytes after upload, {size} were "
                               "sent; rerun the same command")


@reports_storage_errors
def publish_uploaded(local: str, url: str, *, overwrite: bool, stall: float = 600.0) -> dict:
    """Publish a Ray build whose tasks uploaded their shards (to URL/data-<plan digest>/): check that
    every one is there with its size, upload the tokenizer beside them, then the manifest, last."""
    m = load_manifest(local)
    with open(os.path.join(local, PLAN_FILE), "rb") as fh:
        folder = plan_folder(fh.read())
    fs, root = watched_filesystem(url, stall)
    old = _remote_manifest(fs, root, url)
    if old is not None and not overwrite:
        raise ConfigError(f"{redact(url)}: already holds a finished dataset; pass --overwrite to replace it")
    there = remote_sizes(url, folder, stall)
    for s in m["splits"].values():
        for e in s["shards"]:
            for x in (e, *(e.get(side) for side in SIDE_NAMES)):
                if x and there.get(x["path"]) != x["bytes"]:
                    raise DatasetError(f"{redact(url)}: {folder}/{x['path']} is missing or has another size than its "
                                       "task uploaded; rerun the same command")
    # What the driver wrote itself goes beside the tasks' shards: the tokenizer and any bestfit index.
    for p in [m["tokenizer"]["file"], *(x["path"] for s in m["splits"].values() for x in (s.get("index") or {}).values()),
              *(x["path"] for x in (m.get("fields") or {}).get("files", ()))]:
        fs.put_file(os.path.join(local, p), posixpath.join(root, folder, p))
    remote = _prefixed(m, folder)
    fs.pipe_file(posixpath.join(root, MANIFEST), (json.dumps(remote, indent=2) + "\n").encode())
    # The units' own files, which the joins copied into the shards: this build's, in its folder.
    for name in there:
        if re.fullmatch(r"u\d{6}-[a-z]+-\d{4}\.(bin|docs|valid|mask)", name):
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(posixpath.join(root, folder, name))
    if old is not None:
        _remove_replaced(fs, root, url, old)
    return remote


def _prefixed(m: dict, folder: str) -> dict:
    """The manifest with every file path moved under `folder` (as a merged manifest's are under parts)."""
    return _moved(m, lambda p: f"{folder}/{p}")


def _moved(m: dict, move) -> dict:
    """The manifest with every file path p named move(p)."""
    r = json.loads(json.dumps(m))
    r["tokenizer"]["file"] = move(m["tokenizer"]["file"])
    r["splits"] = {k: with_paths(s, move) for k, s in r["splits"].items()}
    if r.get("fields"):
        r["fields"] = moved_fields(r["fields"], move)
    return r


def _remove_replaced(fs, root: str, url: str, old: dict) -> None:
    """Delete what the replaced manifest named and the current one does not (read again just now:
    another build may have published since), and nothing else."""
    current = _remote_manifest(fs, root, url)
    keep = set(manifest_files(current)) if current else set()
    gone = [posixpath.join(root, p) for p in manifest_files(old) if p not in keep and ".." not in p.split("/")]
    for p in gone:
        try:
            fs.rm_file(p)
        except FileNotFoundError:
            pass


@reports_storage_errors
def pull(url: str, dest: str) -> dict:
    """Copy the dataset at `url` to the local folder `dest`, checking each file's sha256 as it arrives;
    the manifest is written last, so `dest` is a dataset only once every file is complete."""
    m = load_manifest(url)
    want = manifest_files(m)  # relative path -> its entry (Digest)
    bad = [p for p in want if ".." in p.split("/") or os.path.isabs(p)]
    if bad:
        raise DatasetError(f"{redact(url)}: manifest names {bad[0]!r}, outside the dataset; refusing to copy it")
    fs, root = watched_filesystem(url)
    # DEST laid out as the pushed dataset was (as `helixtok build` lays it out): the upload's
    # data-<digest>/ folder, under which push put every file, is left out.
    tops = {p.split("/")[0] for p in want}
    folder = tops.pop() if len(tops) == 1 and all("/" in p for p in want) and next(iter(tops)).startswith("data-") \
        else None
    here = (lambda p: p[len(folder) + 1:]) if folder else (lambda p: p)
    os.makedirs(dest, exist_ok=True)
    with OutLock(dest):
        if os.path.isfile(os.path.join(dest, MANIFEST)):
            raise ConfigError(f"{dest}: already holds a dataset; pull into an empty or new folder")
        _refuse_others(dest, {here(p).split("/")[0] for p in want})
        for p in want:
            target = os.path.join(dest, *here(p).split("/"))
            if os.path.isfile(target) and file_matches(target, want[p]):
                continue  # a rerun after an interrupted pull keeps what already arrived intact
            os.makedirs(os.path.dirname(target), exist_ok=True)
            tmp = target + ".part"
            h = Digest(want[p])
            with fs.open(posixpath.join(root, p), "rb", block_size=COPY_BLOCK) as src, open(tmp, "wb") as out:
                while block := src.read(COPY_BLOCK):
                    h.update(block)
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            if not h.ok():
                os.unlink(tmp)
                raise DatasetError(f"{redact(url)}: {p} arrived with another sha256 than the manifest's "
                                   "(changed or corrupt at the source); nothing was published")
            os.replace(tmp, target)
            fsync_dir(os.path.dirname(target))
        if folder:
            m = _moved(m, here)
        write_json_atomic(os.path.join(dest, MANIFEST), m)
    return m


def _refuse_others(dest: str, tops: set[str]) -> None:
    """pull writes the dataset's own top-level names only; anything else in `dest` is the user's."""
    others = sorted(e for e in os.listdir(dest) if e not in tops and not e.startswith(".helixtok"))
    if others:
        raise ConfigError(f"{dest}: holds {others[0]!r}, which is not part of this dataset; pull into an empty "
                          "or new folder (helixtok never touches files it did not write)")
