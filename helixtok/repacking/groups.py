"""A repacked dataset's shard groups: a group's shards linked from the source where the new layout
keeps them, else its work units' documents packed anew (pipeline/pack.py) and placed and closed as a
build places and closes them (pipeline/join.py), so the bytes are a build's by construction."""

from __future__ import annotations

import errno
import os
import shutil

import numpy as np

from ..format.shards import SRC_DTYPE
from ..pipeline.config import BuildConfig
from ..pipeline.join import join_group, piece_tokens
from ..pipeline.journal import piece_name
from ..pipeline.pack import PACKERS, PackCounts
from ..pipeline.unit import UNIT_FILE_TOKENS
from .source import SHARD_NAME, Source

BATCH_TOKENS = 1 << 22  # documents handed to a packer at a time: memory flat however large a unit


def linkable(src: Source, config: BuildConfig, g: int) -> bool:
    """Group g's shards are the very files a build with `config` writes: a packed or bestfit target,
    and the source's pieces cut where the new rule cuts (always, unless an older helixtok cut them)."""
    if config.packing == "document":
        return False
    cap = piece_tokens(config, src.dtype.itemsize)
    for s in src.manifest["splits"]:
        got = [e["num_tokens"] for e in src.pieces(s).get(g, [])]
        n = sum(got)
        if got != [min(cap, n - k * cap) for k in range(-(-n // cap))]:
            return False
    return True


def link_group(src: Source, g: int, state: str, run: str) -> dict:
    """Group g's source shards and sidecars linked into `state` (copied across file systems), as
    join.close_group's entry: {"group", "run", "shards": {split: [entries with "state" names]}}."""
    out = {}
    for s in src.manifest["splits"]:
        entries = []
        for e in src.pieces(s).get(g, []):
            k = int(SHARD_NAME.fullmatch(e["path"]).group(3))
            e = {**e, "state": piece_name(g, s, k)}
            link(src.file(e["path"]), os.path.join(state, e["state"]))
            for side in ("docs", "src", "mask"):
                if side in e:
                    e[side] = {**e[side], "state": f"g{g:06d}.{run}.{s}.{k:04d}.{side}"}
                    link(src.file(e[side]["path"]), os.path.join(state, e[side]["state"]))
            entries.append(e)
        out[s] = entries
    return {"group": g, "run": run, "shards": out}


def link(a: str, b: str) -> None:
    """b becomes a hard link to a (neither is ever written in place again), or a copy where the
    file system cannot link (another device, no hard links)."""
    try:
        os.link(a, b)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        shutil.copyfile(a, b)


def pack_group(src: Source, config: BuildConfig, g: int, state: str, run: str, pad_id: int
               ) -> tuple[dict, dict[str, PackCounts]]:
    """Group g packed anew: each of its work units' documents (the source's unit_documents say which)
    through the new packing into the unit's own files, then placed and closed by join.join_group;
    (its entry, the pad and drop counts per split)."""
    a, b = src.groups[g]
    L, chat = config.seq_len, config.chat is not None
    keep_src = src.manifest.get("unit_sources") is not None  # (a dataset written before sources has none)
    results = [{"index": u, "shards": {}} for u in range(a, b)]
    counts = {s: PackCounts() for s in src.manifest["splits"]}
    for s in src.manifest["splits"]:
        pieces = src.pieces(s).get(g, [])
        ids = [src.ids(e) for e in pieces]  # checked against their segments as read
        masks = [src.mask(e) for e in pieces] if chat else None
        starts, at = [], 0
        for e in pieces:
            starts.append(src.docs(e) + at)
            at += e["num_tokens"]
        bounds = np.append(np.concatenate(starts) if starts else np.empty(0, np.int64), at)
        places = np.concatenate([src.whole(e["src"], SRC_DTYPE) for e in pieces]) if keep_src and pieces else None
        per_unit = src.manifest["unit_documents"][s][a:b]
        if sum(per_unit) != len(bounds) - 1:
            raise _damaged(src, f"shard group {g} of {s} holds {len(bounds) - 1:,} documents where its work units "
                                f"stored {sum(per_unit):,}")
        stream, mstream = _Stream(ids), _Stream(masks) if chat else None
        d = 0
        for r, nd in zip(results, per_unit):
            out = PACKERS[config.packing](os.path.join(state, f"u{r['index']:06d}.{run}.{s}"),
                                          f"u{r['index']:06d}-{s}", src.dtype, L, UNIT_FILE_TOKENS // L * L,
                                          config.tail_len, pad_id, chat=chat, sources=keep_src)
            try:
                for x, y in _batches(bounds, d, d + nd):
                    lens = np.diff(bounds[x: y + 1])
                    lo, hi = int(bounds[x]), int(bounds[y])
                    out.add(stream.take(lo, hi), lens, mask=mstream.take(lo, hi) if chat else None,
                            src=places[x:y] if places is not None else None)
                r["shards"][s] = out.close()
            except BaseException:
                out.abort()
                raise
            counts[s].add(out.counts)
            d += nd
    return join_group(g, results, state, run, src.dtype, config), counts


def _batches(bounds: np.ndarray, d0: int, d1: int):
    """Documents [d0, d1) in runs of about BATCH_TOKENS (a longer document alone)."""
    x = d0
    while x < d1:
        y = int(np.searchsorted(bounds, bounds[x] + BATCH_TOKENS, side="right")) - 1
        y = min(max(y, x + 1), d1)
        yield x, y
        x = y


class _Stream:
    """A group's stream over its pieces (arrays in order): tokens [lo, hi) as one array."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.at = np.concatenate(([0], np.cumsum([len(p) for p in parts]))).astype(np.int64)

    def take(self, lo: int, hi: int) -> np.ndarray:
        k = int(np.searchsorted(self.at, lo, side="right")) - 1
        out = []
        while lo < hi:
            a = lo - int(self.at[k])
            n = min(hi - lo, len(self.parts[k]) - a)
            out.append(self.parts[k][a: a + n])
            lo += n
            k += 1
        return out[0] if len(out) == 1 else np.concatenate(out) if out else self.parts[0][:0]


def _damaged(src: Source, what: str):
    from ..format.errors import DatasetError

    return DatasetError(f"{src.path}: {what}; the dataset is damaged: rebuild it (helixtok verify {src.path} says more)")
