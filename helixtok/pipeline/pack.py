"""A work unit's documents -> its shards, with exact pad/drop accounting.

What a unit stores is a function of its documents alone, so every unit's output is final where
its process writes it: `packed` and `bestfit` store the unit's stream with its document starts
(packed chunks are cut over the split's concatenated stream, bestfit chunks are placed from all
of the split's document lengths: format/bestfit.py), `document` stores whole padded chunks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..format.shards import ShardFiles


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


class _Out:
    """What the three packings share: the unit's shards for one split and its counts."""

    sides: tuple[str, ...] = ()

    def __init__(self, stem: str, final: str, dtype, seq_len: int, cap: int, min_tail: int, pad_id: int,
                 hold: int = 0, chat: bool = False, sources: bool = True):
        self.L, self.dtype, self.min_tail, self.pad_id = seq_len, np.dtype(dtype), min_tail, pad_id
        # Not fsynced: a unit's output is placed into its group's shards, which are; a resume
        # re-hashes it (a file a crash tore is tokenized again), and it may never reach the disk.
        # hold: its ids kept in memory up to that many bytes (placed from there: unit.py).
        # sources False: no .src (a repack of a dataset written before it had them).
        sides = tuple(x for x in self.sides if sources or x != "src") + (("mask",) if chat else ())
        self.files = ShardFiles(stem, final, self.dtype, seq_len, cap, sides, durable=False, hold=hold)
        self.counts = PackCounts()

    def close(self) -> list[dict]:
        return self.files.close()

    def abort(self) -> None:
        self.files.abort()


class PackedOut(_Out):
    """packed: the unit's token stream as it is, with its document starts and where each was read."""

    sides = ("docs", "src")

    def add(self, ids: np.ndarray, lens: np.ndarray, mask: np.ndarray | None = None,
            src: np.ndarray | None = None) -> None:
        self.files.write(ids, starts=np.concatenate(([0], np.cumsum(lens[:-1]))) if len(lens) else None, mask=mask,
                         src=src)

    def start_long(self, src: int = 0) -> None:
        self._first, self._src = True, src

    def write_long(self, ids: np.ndarray) -> None:
        self.files.write(ids, starts=np.zeros(1, np.int64) if self._first else None,
                         src=np.array([self._src], np.uint32) if self._first else None)
        self._first = False

    def end_long(self, n: int) -> None:
        pass


class DocumentOut(_Out):
    """document: each document from a fresh chunk, its tail padded (or dropped below min_tail)."""

    sides = ("valid",)

    def add(self, ids: np.ndarray, lens: np.ndarray, mask: np.ndarray | None = None,
            src: np.ndarray | None = None) -> None:
        chunks, valid, c = document_chunks(ids, lens, self.L, self.min_tail, self.pad_id)
        self.counts.add(c)
        # A chat mask is chunked as its ids are: padding never trains.
        m = None if mask is None else document_chunks(mask, lens, self.L, self.min_tail, 0)[0].reshape(-1)
        self.files.write(chunks.reshape(-1), valid=valid, mask=m)

    # A document read in pieces: its full chunks are written as they come; the last seq_len
    # tokens or fewer wait for its end (whether it is kept depends on its length).
    def start_long(self, src: int = 0) -> None:
        self._carry = np.empty(0, self.dtype)

    def write_long(self, ids: np.ndarray) -> None:
        c = np.concatenate((self._carry, ids))
        full = (len(c) - 1) // self.L  # leave at least one token: the end decides about the rest
        if full:
            self._full_chunks(c[: full * self.L])
        self._carry = c[full * self.L:]

    def _full_chunks(self, ids: np.ndarray) -> None:
        k = len(ids) // self.L
        self.counts.chunks += k
        self.files.write(ids, valid=np.full(k, self.L, np.uint32))

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


# bestfit stores the stream as packed does; the chunks are placed over the whole split (format/bestfit.py).
PACKERS = {"packed": PackedOut, "document": DocumentOut, "bestfit": PackedOut}
