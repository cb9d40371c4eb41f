"""Chunks gathered from pieces of a split's stream: a bestfit index (as stored, or in an epoch's item
order), or a packed split's documents in an epoch's order cut every seq_len tokens."""

from __future__ import annotations

import numpy as np

from ..format.bestfit import Index, epoch_order


class Pieces:
    """Chunk i is pieces first[i] .. first[i+1]-1 back to back, piece j being stream tokens
    [pos[j], pos[j] + size[j]), then padding up to seq_len; `starts[j]` says whether piece j
    begins a document (None: every piece does)."""

    def __init__(self, pos: np.ndarray, size: np.ndarray, first: np.ndarray, starts: np.ndarray | None = None):
        self.pos, self.size, self.first, self.starts = pos, size, first, starts
        ends = np.concatenate(([0], np.cumsum(size)))
        self.filled = ends[first[1:]] - ends[first[:-1]]  # real tokens of each chunk
        self._at = ends[:-1] - np.repeat(ends[first[:-1]], np.diff(first))  # each piece's offset in its chunk

    def __len__(self) -> int:
        return len(self.first) - 1

    def pieces(self, i: int) -> tuple[list[int], list[int]]:
        a, b = int(self.first[i]), int(self.first[i + 1])
        return self.pos[a:b].tolist(), self.size[a:b].tolist()

    def document_starts(self, i: int) -> np.ndarray:
        """Offsets in chunk i where a document (a bestfit item) begins."""
        a, b = int(self.first[i]), int(self.first[i + 1])
        at = self._at[a:b]
        return at if self.starts is None else at[self.starts[a:b]]


def bestfit_pieces(index: Index, seed: int | None = None, epoch: int = 0) -> Pieces:
    """A bestfit index's chunks; with a seed, each chunk's items in the order of (seed, epoch)."""
    if seed is None:
        return Pieces(index.pos, index.size, index.first)
    order = epoch_order(index, seed, epoch)
    return Pieces(index.pos[order], index.size[order], index.first)


def shuffled_documents(doc_pos: np.ndarray, doc_len: np.ndarray, seq_len: int, seed: int, epoch: int) -> Pieces:
    """A packed split's documents in the order of (seed, epoch), concatenated and cut every seq_len
    tokens: as many chunks as the stored order gives (the stream's last partial chunk is left out)."""
    L = seq_len
    perm = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, epoch]).permutation(len(doc_len))
    vlen = doc_len[perm]
    vstart = np.concatenate(([0], np.cumsum(vlen)[:-1])).astype(np.int64)
    chunks = int(vlen.sum()) // L
    end = chunks * L
    cuts = np.union1d(vstart[vstart < end], np.arange(chunks, dtype=np.int64) * L)
    doc = np.searchsorted(vstart, cuts, side="right") - 1
    pos = doc_pos[perm[doc]] + (cuts - vstart[doc])
    size = np.diff(np.append(cuts, end))
    first = np.searchsorted(cuts, np.arange(chunks + 1, dtype=np.int64) * L).astype(np.int64)
    return Pieces(pos.astype(np.int64), size.astype(np.int64), first, starts=cuts == vstart[doc])
