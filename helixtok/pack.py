"""A work unit's documents -> its shards, by the three packings, with exact pad/drop accounting.

Each packing is a function of one unit's documents alone, so every unit's output is final where
its process writes it: `packed` stores the unit's stream (chunks are cut over the split's
concatenated stream when it is read), `document` and `bestfit` store whole padded chunks.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from .shards import ShardFiles

# bestfit packs the documents of a window, consecutive documents of one unit holding at least
# this many tokens (or the unit's rest); measured in docs/packing.md: padding against window size.
BESTFIT_WINDOW = 1 << 20


@dataclass
class PackCounts:
    chunks: int = 0
    pad_tokens: int = 0
    dropped_tokens: int = 0
    dropped_documents: int = 0

    def add(self, other: "PackCounts") -> None:
        self.chunks += other.chunks
        self.pad_tokens += other.pad_tokens
        self.dropped_tokens += other.dropped_tokens
        self.dropped_documents += other.dropped_documents


def document_chunks(ids: np.ndarray, lens: np.ndarray, seq_len: int, min_tail: int, pad_id: int
                    ) -> tuple[np.ndarray, np.ndarray, PackCounts]:
    """Chunk each document on its own (lens include the trailing EOS).

    A document of n ids before EOS is dropped if n < min_tail; else its m = n + 1 ids give
    m // seq_len full chunks, and a remainder r >= min_tail one chunk padded with pad_id
    (0 < r < min_tail is dropped).  Returns (chunks [k, seq_len], valid lengths [k], counts).

    Example: ids=[5, 6, 7, 0], lens=[4], seq_len=3, min_tail=1, pad=0
      -> chunks [[5, 6, 7], [0, 0, 0]] with valid [3, 1], pad_tokens 2.
    """
    counts = PackCounts()
    lens = np.asarray(lens, dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lens)[:-1])) if len(lens) else lens
    keep = (lens - 1) >= min_tail
    counts.dropped_documents = int((~keep).sum())
    counts.dropped_tokens = int(lens[~keep].sum())
    full = lens // seq_len
    rem = lens % seq_len
    has_tail = keep & (rem >= min_tail) & (rem > 0)
    counts.dropped_tokens += int(rem[keep & ~has_tail].sum())
    nrows = np.where(keep, full + has_tail, 0)
    total = int(nrows.sum())
    out = np.full((total, seq_len), pad_id, dtype=ids.dtype)
    valid = np.full(total, seq_len, dtype=np.uint32)
    flat = out.reshape(-1)
    row = 0
    # One slice copy per document: documents are few compared to tokens.
    for s, n, f, t in zip(starts[keep].tolist(), lens[keep].tolist(), full[keep].tolist(), has_tail[keep].tolist()):
        body = f * seq_len
        flat[row * seq_len: row * seq_len + body] = ids[s: s + body]
        row += f
        if t:
            r = n - body
            flat[row * seq_len: row * seq_len + r] = ids[s + body: s + n]
            valid[row] = r
            counts.pad_tokens += seq_len - r
            row += 1
    counts.chunks = total
    return out, valid, counts


def best_fit(sizes: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: bins (lists of item numbers) of total size <= capacity.

    Items go largest first (ties: lower number first), each into the bin it fills most tightly,
    a new bin when none has room.  Deterministic: a function of `sizes` alone.

    Example: sizes [3, 2, 2, 1], capacity 4 -> [[0, 3], [1, 2]].
    """
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin number), sorted
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = sizes[i]
        j = bisect.bisect_left(free, (s, -1))
        if j == len(free):
            bins.append([i])
            b, room = len(bins) - 1, capacity - s
        else:
            room, b = free.pop(j)
            bins[b].append(i)
            room -= s
        if room > 0:
            bisect.insort(free, (room, b))
    return bins


class _Out:
    """What the three packings share: the unit's shards for one split and its counts."""

    sides: tuple[str, ...] = ()

    def __init__(self, stem: str, final: str, dtype, seq_len: int, cap: int, min_tail: int, pad_id: int):
        self.L, self.dtype, self.min_tail, self.pad_id = seq_len, np.dtype(dtype), min_tail, pad_id
        self.files = ShardFiles(stem, final, self.dtype, seq_len, cap, self.sides)
        self.counts = PackCounts()

    def close(self) -> list[dict]:
        self.flush()
        return self.files.close()

    def flush(self) -> None:
        pass

    def abort(self) -> None:
        self.files.abort()


class PackedOut(_Out):
    """packed: the unit's token stream as it is, with its document starts."""

    sides = ("docs",)

    def add(self, ids: np.ndarray, lens: np.ndarray) -> None:
        self.files.write(ids, starts=np.concatenate(([0], np.cumsum(lens[:-1]))) if len(lens) else None)

    def start_long(self) -> None:
        self._first = True

    def write_long(self, ids: np.ndarray) -> None:
        self.files.write(ids, starts=np.zeros(1, np.int64) if self._first else None)
        self._first = False

    def end_long(self, n: int) -> None:
        pass


class DocumentOut(_Out):
    """document: each document from a fresh chunk, its tail padded (or dropped below min_tail)."""

    sides = ("valid",)

    def add(self, ids: np.ndarray, lens: np.ndarray) -> None:
        chunks, valid, c = document_chunks(ids, lens, self.L, self.min_tail, self.pad_id)
        self.counts.add(c)
        self.files.write(chunks.reshape(-1), valid=valid)

    # A document read in pieces: its full chunks are written as they come; the last seq_len
    # tokens or fewer wait for its end (whether it is kept depends on its length).
    def start_long(self) -> None:
        self._carry = np.empty(0, self.dtype)

    def write_long(self, ids: np.ndarray) -> None:
        c = np.concatenate((self._carry, ids))
        full = (len(c) - 1) // self.L  # leave at least one token: the end decides about the rest
        if full:
            self._full_chunks(c[: full * self.L])
        self._carry = c[full * self.L:]

    def _full_chunks(self, ids: np.ndarray) -> None:
        # Each chunk is a piece of the document: where bestfit keeps .docs, each starts an item.
        k = len(ids) // self.L
        self.counts.chunks += k
        self.files.write(ids, starts=np.arange(k, dtype=np.int64) * self.L, valid=np.full(k, self.L, np.uint32))

    def end_long(self, n: int) -> None:
        c, self._carry = self._carry, None
        if n - 1 < self.min_tail:  # (so short it never wrote a chunk)
            self.counts.dropped_documents += 1
            self.counts.dropped_tokens += n
            return
        if len(c) == self.L:
            return self._full_chunks(c)
        self._tail(c)

    def _tail(self, c: np.ndarray) -> None:
        if len(c) >= self.min_tail:
            row = np.full(self.L, self.pad_id, self.dtype)
            row[: len(c)] = c
            self.counts.chunks += 1
            self.counts.pad_tokens += self.L - len(c)
            self.files.write(row, valid=np.array([len(c)], np.uint32))
        else:
            self.counts.dropped_tokens += len(c)


class BestFitOut(DocumentOut):
    """bestfit: every document is an item (longer than seq_len: its seq_len pieces, each a chunk
    of its own, then its last piece as an item); the items of each window are placed by
    best_fit into padded chunks, written in the order of the last piece they hold, so that the
    pieces of a document stay in order.  min_tail drops as document packing does (default 0:
    nothing dropped)."""

    sides = ("docs", "valid")

    def __init__(self, *a, window: int = BESTFIT_WINDOW, **kw):
        super().__init__(*a, **kw)
        self.window = window
        self._items: list[tuple[tuple[int, int], np.ndarray]] = []  # ((document, piece), ids), in order
        self._held = 0  # tokens in _items
        self._doc = 0  # documents of this split seen in the unit

    def add(self, ids: np.ndarray, lens: np.ndarray) -> None:
        ends = np.cumsum(lens).tolist()
        for a, b in zip([0] + ends[:-1], ends):
            self._add_doc(ids[a:b])

    def _add_doc(self, d: np.ndarray) -> None:
        m, L = len(d), self.L
        if m - 1 < self.min_tail:
            self.counts.dropped_documents += 1
            self.counts.dropped_tokens += m
        else:
            full = m // L
            for p in range(full):
                self._item((self._doc, p), d[p * L: (p + 1) * L])
            if m % L:
                if m % L >= self.min_tail:
                    self._item((self._doc, full), d[full * L:])
                else:
                    self.counts.dropped_tokens += m % L
        self._doc += 1
        if self._held >= self.window:
            self.flush()

    def _item(self, key: tuple[int, int], ids: np.ndarray) -> None:
        self._items.append((key, ids))
        self._held += len(ids)

    def flush(self) -> None:
        """Pack the window: best fit over its items, chunks in the order of their last piece."""
        items, self._items, self._held = self._items, [], 0
        if not items:
            return
        L = self.L
        bins = [sorted(b) for b in best_fit([len(ids) for _, ids in items], L)]
        bins.sort(key=lambda b: items[b[-1]][0])
        out = np.full((len(bins), L), self.pad_id, self.dtype)
        valid = np.empty(len(bins), np.uint32)
        starts = []
        for r, b in enumerate(bins):
            at = 0
            for i in b:
                ids = items[i][1]
                starts.append(r * L + at)
                out[r, at: at + len(ids)] = ids
                at += len(ids)
            valid[r] = at
        self.counts.chunks += len(bins)
        self.counts.pad_tokens += len(bins) * L - int(valid.sum(dtype=np.int64))
        self.files.write(out.reshape(-1), starts=np.array(starts, np.int64), valid=valid)

    # A document read in pieces: the window so far goes first, then its full pieces as chunks
    # (each its own item, in order); its last piece opens the next window.
    def start_long(self) -> None:
        self.flush()
        super().start_long()

    def end_long(self, n: int) -> None:
        self._tail_piece = (self._doc, n // self.L)
        super().end_long(n)
        self._doc += 1

    def _tail(self, c: np.ndarray) -> None:
        if len(c) >= self.min_tail:
            self._item(self._tail_piece, c)
        else:
            self.counts.dropped_tokens += len(c)


PACKERS = {"packed": PackedOut, "document": DocumentOut, "bestfit": BestFitOut}
