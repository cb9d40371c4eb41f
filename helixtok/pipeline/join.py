"""Shard groups: consecutive work units whose outputs make shards of about --shard-size, planned from
the input alone; placing a unit's output at its offset in its group's shards, and closing a group.

A unit's place in its group's stream is the sum of the tokens of the units before it, known as soon
as they are tokenized (journaled, not written): so units are placed in any order, by any process.
The process that tokenized a unit places it from memory as it ends when it can (place_unit with `held`: its
ids written once); otherwise it writes them to its own file and a worker copies that file into
place (place_unit), checking it against the sha256 its unit recorded.  Each placed range is a
*segment* of its shard, recorded with the sha256 of the very bytes written: a shard's integrity
is its segments' digests (docs/format.md), so no shard is ever read back to be hashed.
dispatch.Joins says where each step runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import numpy as np

from ..format import limits
from ..format.errors import HelixtokError
from ..format.shards import DOCS_DTYPE, MASK_DTYPE, SRC_DTYPE, VALID_DTYPE, HashedFile, start_writeback
from .journal import done_path, piece_name, placed_path, read_entry, shard_stem, state_files, write_entry

# Text bytes per token, to size shard groups before anything is tokenized: English with a 32k-128k
# BPE gives 3.5-4.5 (the dev corpus with Llama-3.2: 3.9), code ~3, CJK ~1.5-2 (shards then up to
# 2x the size asked for: past that a group's stream goes on in a second piece).
BYTES_PER_TOKEN = 4
BLOCK_BYTES = 1 << 20  # read, hashed and written per step: memory stays flat however large a unit


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


def piece_tokens(config, itemsize: int) -> int:
    """Tokens a shard (a piece of its group's stream) holds at most: 2 x --shard-size bytes, in whole
    chunks for `document` (its shards hold rows); for `packed` and `bestfit` whatever the sequence
    length, so their shards are the same for every --seq-len and either packing (a repack links them)."""
    n = max(1, limits.SHARD_LIMIT * config.shard_bytes // itemsize)
    return max(1, n // config.seq_len) * config.seq_len if config.packing == "document" else n


def placed_from(r: dict) -> list:
    """The unit files a placement copied, [state name, sha256] each: a resume trusts a placement
    only with the very journal entry it was made from."""
    return [[e["state"], e["sha256"]] for entries in r["shards"].values() for e in entries]


def _unit_file(state: str):
    return lambda x: open(os.path.join(state, x["state"]), "rb")


def place_unit(r: dict, g: int, offsets: dict[str, int], state: str, dtype, config, opener=None,
               drop: bool = True, held: dict | None = None) -> dict:
    """Write unit `r`'s ids (its journal entry) into group `g`'s shards in `state`, starting at
    `offsets` (per split: tokens of the group's units before it); returns and journals its placement
    (placement()).  Each split on its own: from memory where its process still holds its ids
    (`held`: split -> shards.HeldIds, for entries without a "sha256", which they then get), else
    from its file (in `state`, or opened by `opener`), checked against the sha256 its unit recorded
    as it is copied (a file changed in between stops the build).  `drop`: the unit's .bin files are
    deleted once placed (its sidecars stay for close_group)."""
    opener = opener or _unit_file(state)
    held = held or {}
    buf = bytearray(BLOCK_BYTES)

    def place(split: str, e: dict, pos: int, put) -> list:
        if split in held:
            segs, e["sha256"] = put(held[split].blocks())
            return segs
        with opener(e) as src:
            segs, sha = put(_file_blocks(src, buf))
        _same(e, sha)
        return segs
    p = _place_all(r, g, offsets, state, dtype, config, place)
    if drop:
        for split, entries in r["shards"].items():
            for e in entries if split not in held else ():
                try:
                    os.remove(os.path.join(state, e["state"]))
                except FileNotFoundError:
                    pass
    return p


def _place_all(r: dict, g: int, offsets: dict[str, int], state: str, dtype, config, place) -> dict:
    """The placement of unit `r` ({"index", "group", "at": its offsets, "segments": {split: [[piece,
    byte offset, bytes, sha256], ...]}, "from": placed_from(r)}), each of its entries written by
    place(split, entry, offset, put), put(blocks) writing the blocks: journaled."""
    item = np.dtype(dtype).itemsize
    cap = piece_tokens(config, item)
    segments: dict[str, list] = {}
    fds: dict[str, int] = {}
    try:
        for split, entries in r["shards"].items():
            pos, segs = offsets.get(split, 0), segments.setdefault(split, [])
            for e in entries:
                def put(blocks, split=split, e=e, pos=pos):
                    return _write_ranges(e, blocks, g, split, pos, cap, item, state, fds)
                segs += place(split, e, pos, put)
                pos += e["num_tokens"]
    finally:
        for fd in fds.values():
            os.close(fd)
    placed = {"index": r["index"], "group": g, "at": {s: offsets.get(s, 0) for s in r["shards"]},
              "segments": segments, "from": placed_from(r)}
    write_entry(placed_path(state, r["index"]), placed)
    return placed


def _file_blocks(src, buf: bytearray):
    view = memoryview(buf)
    while got := src.readinto(view):
        yield view[:got]  # the same buffer each time: used before the next is read


def _write_ranges(e: dict, blocks, g: int, split: str, pos: int, cap: int, item: int, state: str,
                  fds: dict) -> tuple[list, str]:
    """One unit file's ids (entry `e`, given as byte `blocks` in order) written at token `pos` of
    group g's `split` stream, piece by piece: its segments and the sha256 of all of its bytes."""
    ranges = []  # (piece, byte offset in it, bytes): a segment each
    seg = max(1, limits.SEGMENT_BYTES // item)  # tokens: segments end at multiples of it in a piece
    a, left = pos, e["num_tokens"]
    while left:
        k, at = divmod(a, cap)
        n = min(left, cap - at, seg - at % seg)
        ranges.append((k, at * item, n * item))
        a, left = a + n, left - n
    whole, segs = hashlib.sha256(), []
    stream = _Exact(blocks)
    for k, off, n in ranges:
        name = piece_name(g, split, k)
        if name not in fds:
            fds[name] = os.open(os.path.join(state, name), os.O_WRONLY | os.O_CREAT, 0o644)
        fd = fds[name]
        h = whole if len(ranges) == 1 else hashlib.sha256()  # one range: one hash serves both
        done = 0
        for chunk in stream.take(n):
            h.update(chunk)
            if h is not whole:
                whole.update(chunk)
            w = 0
            while w < len(chunk):
                w += os.pwrite(fd, chunk[w:], off + done + w)
            done += len(chunk)
        if done != n:
            raise HelixtokError(f"{e['state']}: shorter than the {e['num_tokens']} tokens its work unit wrote; "
                                "rerun the same command: the unit is tokenized again")
        if (start := start_writeback()) is not None:
            start(fd, off, n, 2)  # a hint: the group's fsync finds little left to write
        segs.append([k, off, n, h.hexdigest()])
    if stream.more():
        raise HelixtokError(f"{e['state']}: longer than the {e['num_tokens']} tokens its work unit wrote; "
                            "rerun the same command: the unit is tokenized again")
    return segs, whole.hexdigest()


class _Exact:
    """Byte views from an iterator of them, taken n bytes at a time."""

    def __init__(self, blocks):
        self._it, self._rest = iter(blocks), memoryview(b"")

    def take(self, n: int):
        while n:
            if not len(self._rest):
                self._rest = next(self._it, None)
                if self._rest is None:
                    self._rest = memoryview(b"")
                    return
            chunk, self._rest = self._rest[:n], self._rest[n:]
            n -= len(chunk)
            yield chunk

    def more(self) -> bool:
        return bool(len(self._rest)) or any(len(b) for b in self._it)


def close_group(g: int, results: list[dict], placements: list[dict], state: str, run: str, dtype, config,
                opener=None) -> dict:
    """Group `g`'s entry once every unit of it (journal entries `results`, in unit order) is placed
    (`placements`, the same order): each shard's segments checked to cover it exactly, the shard
    fsynced, its sidecars (.docs offsets moved to the shard's, .valid) written from the units'
    (each checked against its sha256): {"group", "run", "shards": {split: [shard entries, each
    with its "state" name]}}."""
    from .pack import PACKERS

    opener = opener or _unit_file(state)
    item = np.dtype(dtype).itemsize
    L, cap = config.seq_len, piece_tokens(config, item)
    # .src only where the units wrote one (a repack of a dataset written before sources has none).
    has_src = any("src" in e for r in results for es in r["shards"].values() for e in es)
    sides = tuple(x for x in PACKERS[config.packing].sides + (("mask",) if config.chat else ()) if x != "src" or has_src)
    splits = ("train", "val") if config.has_val else ("train",)
    out = {}
    for s in splits:
        pos, starts, valid, srcs = 0, [], [], []
        for r in results:
            for e in r["shards"].get(s, []):
                if "docs" in e:
                    starts.append(_whole(opener, e["docs"], DOCS_DTYPE).astype(np.int64) + pos)
                if "src" in e:
                    srcs.append(_whole(opener, e["src"], SRC_DTYPE))
                if "valid" in e:
                    valid.append(_whole(opener, e["valid"], VALID_DTYPE))
                pos += e["num_tokens"]
        # A chat build's masks, one byte a token: taken unit by unit as the pieces need them.
        masks = _Exact(memoryview(_whole(opener, e["mask"], MASK_DTYPE)) for r in results
                       for e in r["shards"].get(s, []) if "mask" in e)
        starts_all = np.concatenate(starts) if starts else np.empty(0, np.int64)
        valid_all = np.concatenate(valid) if valid else np.empty(0, VALID_DTYPE)
        src_all = np.concatenate(srcs) if srcs else np.empty(0, SRC_DTYPE)  # one per document start
        by_piece: dict[int, list] = {}
        for p in placements:
            for k, off, n, sha in p["segments"].get(s, []):
                by_piece.setdefault(k, []).append((off, n, sha))
        entries = []
        for k in range(-(-pos // cap)):
            ntok = min(cap, pos - k * cap)
            segs = by_piece.get(k, [])
            at = 0
            for off, n, _ in segs:
                at = at + n if off == at else -1
            if at != ntok * item:
                raise HelixtokError(f"shard {s}-{g:06d}-{k:04d}: its placed segments do not cover it; rerun the "
                                    "same command")
            name = piece_name(g, s, k)
            fd = os.open(os.path.join(state, name), os.O_RDWR)
            try:
                if os.fstat(fd).st_size != ntok * item:
                    raise HelixtokError(f"{name}: {os.fstat(fd).st_size} bytes where its segments hold {ntok * item}"
                                        "; rerun the same command")
                os.fsync(fd)
            finally:
                os.close(fd)
            e = {"path": f"{shard_stem(g, s, k)}.bin", "state": name, "bytes": ntok * item, "num_tokens": ntok,
                 "segments": [[n, sha] for _, n, sha in segs]}
            lo, hi = k * cap, k * cap + ntok
            for side in sides:
                stem = f"g{g:06d}.{run}.{s}.{k:04d}.{side}"
                f = HashedFile(os.path.join(state, stem))
                try:
                    if side in ("docs", "src"):
                        a, b = np.searchsorted(starts_all, [lo, hi])
                        f.write((starts_all[a:b] - lo).astype(DOCS_DTYPE) if side == "docs" else src_all[a:b])
                    elif side == "mask":
                        for part in masks.take(hi - lo):
                            f.write(np.frombuffer(part, MASK_DTYPE))
                    else:
                        a, b = lo // L, hi // L
                        f.write(valid_all[a:b])
                    got = f.commit()
                except BaseException:
                    f.abort()
                    raise
                e[side] = {"path": f"{shard_stem(g, s, k)}.{side}", "state": stem, **got}
                if side == "docs":
                    e[side]["count"] = int(b - a)
            entries.append(e)
        out[s] = entries
    return {"group": g, "run": run, "shards": out}


def join_group(g: int, results: list[dict], state: str, run: str, dtype, config, opener=None,
               placed: dict[int, dict] | None = None) -> dict:
    """Group `g`'s shards from its units' journal entries (in unit order), in one process: each
    placed in turn, then the group closed (a Ray task's join).  `placed`: the placements an
    interrupted build made that a resume trusts (their units' files are gone: not placed again)."""
    pos: dict[str, int] = {}
    placements = []
    for r in results:
        p = (placed or {}).get(r["index"])
        if p is not None and p["at"] != {s: pos.get(s, 0) for s in r["shards"]}:
            for path in (placed_path(state, r["index"]), done_path(state, r["index"])):  # forgotten: redone
                with contextlib.suppress(OSError):
                    os.remove(path)
            raise HelixtokError(f"work unit {r['index']}: its placement in shard {g} disagrees with the units before "
                                "it (damaged); rerun the same command: it is tokenized again")
        placements.append(p or place_unit(r, g, pos, state, dtype, config, opener, drop=opener is None))
        pos = offsets_after(r, pos)
    return close_group(g, results, placements, state, run, dtype, config, opener)


def offsets_after(r: dict, pos: dict[str, int]) -> dict[str, int]:
    """The group stream offsets after unit `r`, from those before it."""
    out = dict(pos)
    for s, entries in r["shards"].items():
        out[s] = out.get(s, 0) + sum(e["num_tokens"] for e in entries)
    return out


def known_offsets(state: str, g: int, a: int, i: int, cache: dict) -> dict[str, int] | None:
    """Unit i's offsets in group g (whose first unit is a), if every unit before it in the group is
    journaled: their entries in `state` say how many tokens each holds (a function of the plan: the
    build's own process checks each placement's offsets against its own count).  `cache`: what was
    read, per group (one run's)."""

    known = cache.setdefault(g, [{}])  # known[j - a]: unit j's offsets
    while len(known) <= i - a:
        j = a + len(known) - 1
        r = read_entry(done_path(state, j))
        try:
            if r is None or r["index"] != j:
                return None
            known.append(offsets_after(r, known[-1]))
        except (KeyError, TypeError, AttributeError):
            return None
    return known[i - a]


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


def segments_hold(path: str, segments: list) -> bool:
    """Whether the file at `path` holds `segments` ([piece-relative byte offset, bytes, sha256] each)
    where they say: a resumed build's check of what an interrupted one placed."""
    try:
        with open(path, "rb") as fh:
            for off, n, sha in segments:
                fh.seek(off)
                h, left = hashlib.sha256(), n
                while left:
                    block = fh.read(min(left, BLOCK_BYTES))
                    if not block:
                        return False
                    h.update(block)
                    left -= len(block)
                if h.hexdigest() != sha:
                    return False
    except OSError:
        return False
    return True


def join_uploaded(g: int, results: list[dict], run: str, dtype, config, remote: tuple[str, str]) -> dict:
    """join_group for units its Ray tasks uploaded to URL/folder: read from there, joined in a temp
    folder of this node's, the group's shards uploaded beside them."""
    import posixpath
    import shutil
    import tempfile

    from ..format.objstore import filesystem
    from .publish import upload_unit

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


def load_placed(state: str, index: int) -> dict | None:
    """An interrupted build's placement of unit `index`, if it journaled one."""
    p = read_entry(placed_path(state, index))
    return p if p is not None and p.get("index") == index else None
