"""Shard groups: consecutive work units whose outputs are joined into shards of about --shard-size,
planned from the input alone, and the join that writes them (dispatch.Joins says where it runs)."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from .errors import HelixtokError
from .shards import DOCS_DTYPE, VALID_DTYPE, ShardFiles

# Text bytes per token, to size shard groups before anything is tokenized: English with a 32k-128k
# BPE gives 3.5-4.5 (the dev corpus with Llama-3.2: 3.9), code ~3, CJK ~1.5-2 (shards then up to
# 2x the size asked for: the join never writes one larger, it starts a second).
BYTES_PER_TOKEN = 4
LIMIT = 2  # no shard holds more than LIMIT x --shard-size bytes


def shard_groups(units, shard_bytes: int, itemsize: int) -> list[tuple[int, int]]:
    """Consecutive unit ranges [a, b) each expected to give about `shard_bytes` of ids (from their
    input bytes): a function of the plan alone, so the shards are the same for any worker count,
    partitioning or executor."""
    target = shard_bytes / itemsize * BYTES_PER_TOKEN  # input bytes per group
    groups, a, acc = [], 0, 0
    for i, u in enumerate(units):
        acc += u.est_bytes
        if acc >= target:
            groups.append((a, i + 1))
            a, acc = i + 1, 0
    if a < len(units):
        groups.append((a, len(units)))
    return groups


BLOCK_TOKENS = 1 << 20  # read per step: memory stays flat however large a unit's output


class GroupWriter:
    """One shard group's shards being written, per split, in `state`: its units' outputs (journal
    entries) appended in unit order, read in blocks, hashed as written.  `opener(x)`: the unit
    file of entry x opened for reading (default: x's name in `state`)."""

    def __init__(self, g: int, state: str, run: str, dtype, config, opener=None):
        from .pack import PACKERS

        self.g, self.run = g, run
        self.opener = opener or (lambda x: open(os.path.join(state, x["state"]), "rb"))
        self.dtype, self.L = np.dtype(dtype), config.seq_len
        cap = max(1, LIMIT * config.shard_bytes // (self.L * self.dtype.itemsize)) * self.L
        splits = ("train", "val") if config.val_fraction > 0 else ("train",)
        self.files = {s: ShardFiles(os.path.join(state, f"g{g:06d}.{run}.{s}"), f"{s}-{g:06d}", self.dtype, self.L,
                                    cap, PACKERS[config.packing].sides) for s in splits}

    def append(self, r: dict) -> None:
        step = max(1, BLOCK_TOKENS // self.L) * self.L  # whole chunks: .valid is per chunk
        for split, entries in r["shards"].items():
            files = self.files[split]
            for e in entries:
                n = e["num_tokens"]
                starts = _whole(self.opener, e["docs"], DOCS_DTYPE).astype(np.int64) if "docs" in e else None
                valid = _whole(self.opener, e["valid"], VALID_DTYPE) if "valid" in e else None
                h = hashlib.sha256()  # what is copied is what the unit wrote, or the build stops
                with self.opener(e) as fh:
                    for a in range(0, n, step):
                        b = min(n, a + step)
                        buf = fh.read((b - a) * self.dtype.itemsize)
                        h.update(buf)
                        ids = np.frombuffer(buf, dtype=self.dtype)
                        if len(ids) != b - a:
                            raise OSError(f"{e['state']}: shorter than the {n} tokens its unit wrote")
                        files.write(ids, starts=None if starts is None else starts[(starts >= a) & (starts < b)] - a,
                                    valid=None if valid is None else valid[a // self.L: b // self.L])
                _same(e, h.hexdigest())

    def close(self) -> dict:
        """The group's entry: {"group", "run", "shards": {split: [shard entries, "state" names beside]}}."""
        return {"group": self.g, "run": self.run, "shards": {s: f.close() for s, f in self.files.items()}}

    def abort(self) -> None:
        for f in self.files.values():
            f.abort()


def join_group(g: int, results: list[dict], state: str, run: str, dtype, config, opener=None) -> dict:
    """Group `g`'s shards from its units' journal entries (in unit order), at once."""
    w = GroupWriter(g, state, run, dtype, config, opener)
    try:
        for r in results:
            w.append(r)
        return w.close()
    except BaseException:
        w.abort()
        raise


def _whole(opener, x: dict, dtype) -> np.ndarray:
    """A (small) sidecar, checked against the size and sha256 its unit recorded."""
    with opener(x) as fh:
        data = fh.read()
    _same(x, hashlib.sha256(data).hexdigest())
    return np.frombuffer(data, dtype=dtype)


def _same(x: dict, sha: str) -> None:
    if sha != x["sha256"]:
        raise HelixtokError(f"{x['state']}: changed since its work unit wrote it (sha256 differs); rerun the same "
                            "command: the unit is tokenized again")


def join_uploaded(g: int, results: list[dict], run: str, dtype, config, remote: tuple[str, str]) -> dict:
    """join_group for units its Ray tasks uploaded to URL/folder: read from there, joined in a temp
    folder of this node's, the group's shards uploaded beside them."""
    import posixpath
    import shutil
    import tempfile

    from .objstore import filesystem
    from .publish import upload_unit
    from .unit import state_files

    url, folder = remote
    fs, root = filesystem(url)
    local = tempfile.mkdtemp(prefix="helixtok-join-")
    try:
        entry = join_group(g, results, local, run, dtype, config,
                           opener=lambda x: fs.open(posixpath.join(root, folder, x["path"]), "rb"))
        upload_unit(local, list(state_files(entry)), url, folder, config.stall_seconds)
        return entry
    finally:
        shutil.rmtree(local, ignore_errors=True)
