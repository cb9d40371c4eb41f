"""Token stream -> fixed-length chunks: the two packings, with exact pad/drop accounting."""

from __future__ import annotations

import base64
from dataclasses import dataclass

import numpy as np


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


class StreamPacker:
    """Feeds one split's token stream, slice by slice, to a ShardWriter as full chunks, each
    with the document starts inside it; `carry` is what has not filled a chunk yet."""

    def __init__(self, writer, seq_len: int, dtype):
        self.writer, self.seq_len = writer, seq_len
        self.carry = np.empty(0, dtype)
        self.pending = np.empty(0, np.int64)  # document starts in the carry, stream positions
        self.pos = 0  # tokens of the stream seen so far

    def mark(self) -> dict:
        return {"pos": self.pos, "pending": self.pending.tolist(),
                "carry": base64.b64encode(self.carry.astype(self.carry.dtype.newbyteorder("<")).tobytes()).decode()}

    def reopen(self, mark: dict) -> None:
        """Go on from `mark` (a packer made with the same arguments, its writer reopened)."""
        self.pos = mark["pos"]
        self.pending = np.array(mark["pending"], np.int64)
        self.carry = np.frombuffer(base64.b64decode(mark["carry"]), self.carry.dtype.newbyteorder("<")).astype(
            self.carry.dtype)

    def add(self, ids: np.ndarray, starts: np.ndarray) -> None:
        """ids: the next slice of the stream; starts: sorted stream positions of document starts
        (only those inside this slice are used).  Full chunks go to the writer as views of
        `ids`: only the chunk that completes the carry is copied."""
        L, n_carry = self.seq_len, len(self.carry)
        a, b = np.searchsorted(starts, [self.pos, self.pos + len(ids)])
        written = self.writer.num_chunks * L
        all_starts = np.concatenate((self.pending, starts[a:b])) - written  # from the carry's first token
        self.pos += len(ids)
        full = (n_carry + len(ids)) // L
        if full == 0:
            self.carry = np.concatenate((self.carry, ids))
            self.pending = all_starts + written
            return
        cut = np.searchsorted(all_starts, full * L)
        done, rest = all_starts[:cut], ids
        if n_carry:
            head = np.concatenate((self.carry, ids[: L - n_carry])).reshape(1, L)
            i = np.searchsorted(done, L)
            self.writer.write(head, doc_starts=done[:i])
            done, rest, full = done[i:] - L, ids[L - n_carry:], full - 1
        self.writer.write(rest[: full * L].reshape(full, L), doc_starts=done)
        self.carry = rest[full * L:].copy()
        self.pending = all_starts[cut:] + written


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
    has_tail = keep & (rem >= min_tail)
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
