"""bestfit: a split's chunks as pieces of its token stream, placed by best-fit decreasing over the
whole split from its document lengths alone (no token is read), and each epoch's order inside them."""

from __future__ import annotations

import bisect
import hashlib
import heapq
import os
from dataclasses import dataclass

import numpy as np

from .errors import DatasetError
from .manifest import check_small_file

ITEM_DTYPE = np.dtype("<u8")  # .items: (stream position, tokens) per item, in chunk order
CHUNK_DTYPE = np.dtype("<u8")  # .chunks: each chunk's first item, then the number of items


@dataclass
class Index:
    """Where every chunk's items lie in the split's stream: chunk i holds items
    first[i] .. first[i+1]-1, item j being tokens [pos[j], pos[j] + size[j]) of the stream,
    back to back, then padding up to seq_len."""

    pos: np.ndarray  # int64 [items]
    size: np.ndarray  # int64 [items]
    first: np.ndarray  # int64 [chunks + 1]
    pad_tokens: int = 0
    dropped_tokens: int = 0
    dropped_documents: int = 0
    entry: dict | None = None  # its files' manifest entry, once written

    @property
    def num_chunks(self) -> int:
        return len(self.first) - 1

    def problem(self, seq_len: int, stream: int) -> str | None:
        """Why this index cannot be the one of a stream of `stream` tokens, or None."""
        f = self.first
        if len(f) == 0 or f[0] != 0 or f[-1] != len(self.pos) or (np.diff(f) < 1).any():
            return "its chunks do not list its items in order"
        if len(self.pos) and ((self.size < 1).any() or (self.pos + self.size > stream).any()):
            return f"an item lies outside the split's {stream} tokens"
        if (self.filled() > seq_len).any():
            return f"a chunk holds more than seq_len {seq_len} tokens"
        return None

    def filled(self) -> np.ndarray:
        """Real tokens at the start of each chunk."""
        c = np.concatenate(([0], np.cumsum(self.size)))
        return c[self.first[1:]] - c[self.first[:-1]]


def place(sizes: np.ndarray, capacity: int) -> np.ndarray:
    """Best-fit decreasing: the bin of each item (bins numbered as opened), sizes 1..capacity.

    Items go largest first (ties: lower number first), each into the open bin whose room left is
    the smallest that still holds it (ties: the bin opened first), a new bin when none has room.

    Example: place([3, 2, 2, 1], 4) -> [0, 1, 1, 0].
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    n = len(sizes)
    order = np.lexsort((np.arange(n), -sizes))
    out = np.empty(n, dtype=np.int64)
    # Items over half the capacity never share a bin with one another: each opens its own, in
    # order, without the search (on real text most items are long, and pieces of long documents).
    big = int(np.searchsorted(-sizes[order], -(capacity // 2), side="left"))
    out[order[:big]] = np.arange(big)
    rooms = capacity - sizes[order[:big]]
    buckets: dict[int, list[int]] = {}  # room left -> heap of bin numbers with that room
    for b, r in enumerate(rooms.tolist()):
        if r:
            buckets.setdefault(r, []).append(b)  # bin numbers ascending: already a heap
    free = sorted(buckets)  # the room values some open bin has
    nbins = big
    for i, s in zip(order[big:].tolist(), sizes[order[big:]].tolist()):
        j = bisect.bisect_left(free, s)
        if j == len(free):
            b, room = nbins, capacity - s
            nbins += 1
        else:
            r = free[j]
            heap = buckets[r]
            b = heapq.heappop(heap)
            if not heap:
                del buckets[r]
                del free[j]
            room = r - s
        out[i] = b
        if room:
            heap = buckets.get(room)
            if heap is None:
                buckets[room] = [b]
                bisect.insort(free, room)
            else:
                heapq.heappush(heap, b)
    return out


def build_index(doc_pos: np.ndarray, doc_len: np.ndarray, seq_len: int, min_tail: int) -> Index:
    """The split's chunks from its documents (stream position and tokens, EOS included, in corpus order).

    Every document is cut into pieces of seq_len at fixed positions; a document of n = len - 1 <
    min_tail ids is dropped, and so is a last piece shorter than min_tail.  Full pieces are chunks
    of their own; the rest are placed by `place`.  Chunks go in the order of the last item each
    holds, items inside a chunk in (document, piece) order: a function of the lengths alone.
    """
    L = seq_len
    doc_pos = np.asarray(doc_pos, dtype=np.int64)
    doc_len = np.asarray(doc_len, dtype=np.int64)
    keep = doc_len - 1 >= min_tail
    dropped_documents = int((~keep).sum())
    dropped = int(doc_len[~keep].sum())
    pos, m = doc_pos[keep], doc_len[keep]
    full, tail = m // L, m % L
    has_tail = (tail > 0) & (tail >= min_tail)
    dropped += int(tail[(tail > 0) & ~has_tail].sum())
    pieces = full + has_tail
    # Item k of document d: its piece (k - first piece of d), at pos[d] + piece * L.
    doc_of = np.repeat(np.arange(len(m)), pieces)
    piece = np.arange(len(doc_of)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    ipos = pos[doc_of] + piece * L
    isize = np.where(piece < full[doc_of], L, tail[doc_of])
    # Full pieces fill a chunk alone; best fit places the rest.
    part = isize < L
    bins = np.empty(len(isize), dtype=np.int64)
    nfull = int((~part).sum())
    bins[~part] = np.arange(nfull)
    bins[part] = place(isize[part], L) + nfull if part.any() else bins[part]
    nbins = int(bins.max()) + 1 if len(bins) else 0
    # Chunk order: by the last item (highest item number) each holds; items ascending within.
    last = np.full(nbins, -1, dtype=np.int64)
    np.maximum.at(last, bins, np.arange(len(bins)))
    rank = np.empty(nbins, dtype=np.int64)
    rank[np.argsort(last, kind="stable")] = np.arange(nbins)
    chunk = rank[bins]
    order = np.lexsort((np.arange(len(bins)), chunk))
    first = np.concatenate(([0], np.cumsum(np.bincount(chunk, minlength=nbins)))).astype(np.int64)
    return Index(ipos[order], isize[order], first, pad_tokens=nbins * L - int(isize.sum()), dropped_tokens=dropped,
                 dropped_documents=dropped_documents)


def epoch_order(index: Index, seed: int, epoch: int) -> np.ndarray:
    """A new order of the items inside every chunk for (seed, epoch): a permutation of the item
    numbers that keeps each chunk's items in its own slots (chunks and their padding unchanged)."""
    n = len(index.pos)
    keys = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, epoch, 1]).random(n)
    chunk = np.repeat(np.arange(index.num_chunks), np.diff(index.first))
    return np.lexsort((keys, chunk))


def doc_spans(shards: list[tuple[int, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Every document's (stream position, tokens) from the shards' (tokens, .docs offsets) in order."""
    starts, at = [], 0
    for n, offs in shards:
        starts.append(np.asarray(offs, dtype=np.int64) + at)
        at += n
    pos = np.concatenate(starts) if starts else np.empty(0, np.int64)
    return pos, np.diff(np.append(pos, at))


def index_files(split: str) -> dict[str, str]:
    return {"items": f"{split}.items", "chunks": f"{split}.chunks"}


def write_index(folder: str, split: str, idx: Index) -> dict:
    """Write the split's index files into `folder` (temp, fsync, rename); their manifest entry."""
    arrays = {"items": np.stack((idx.pos, idx.size), axis=1).astype(ITEM_DTYPE),
              "chunks": idx.first.astype(CHUNK_DTYPE)}
    entry = {}
    for kind, name in index_files(split).items():
        data = arrays[kind].tobytes()
        path = os.path.join(folder, name)
        tmp = os.path.join(folder, f".{name}.tmp")
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        entry[kind] = {"path": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                       **({"count": len(idx.pos)} if kind == "items" else {})}
    return entry


def load_index(read, entry: dict, seq_len: int, stream: int, root: str) -> Index:
    """A split's index (`entry`: its manifest's "index"), each file's bytes from read(path), refused
    in one line unless each has the manifest's sha256 and the index fits the split's `stream` tokens
    (`root`: where the paths are, for the message)."""
    data = {}
    for k in ("items", "chunks"):
        data[k] = read(entry[k]["path"])
        check_small_file(os.path.join(root, entry[k]["path"]), data[k], entry[k].get("sha256"))
    idx = from_bytes(data["items"], data["chunks"])
    why = idx.problem(seq_len, stream)
    if why:
        raise DatasetError(f"{os.path.join(root, entry['items']['path'])}: {why}; the index is damaged: rebuild the "
                           "dataset (helixtok verify says more)")
    return idx


def from_bytes(items: bytes | np.ndarray, chunks: bytes | np.ndarray) -> Index:
    """An Index read back from its two files' contents."""
    it = np.frombuffer(items, dtype=ITEM_DTYPE).reshape(-1, 2).astype(np.int64)
    return Index(it[:, 0].copy(), it[:, 1].copy(), np.frombuffer(chunks, dtype=CHUNK_DTYPE).astype(np.int64))
