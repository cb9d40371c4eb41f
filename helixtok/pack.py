"""Token stream -> fixed-length chunks: the two packings, with exact pad/drop accounting."""

from __future__ import annotations

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


def packed_chunks(carry: np.ndarray, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Append ids to the carried tokens; return (full chunks [k, seq_len], new carry < seq_len).

    Example: carry=[1], ids=[2, 3, 4, 5], seq_len=2 -> chunks [[1, 2], [3, 4]], carry [5].
    """
    stream = np.concatenate((carry, ids)) if len(carry) else ids
    k = len(stream) // seq_len
    return stream[: k * seq_len].reshape(k, seq_len), stream[k * seq_len:].copy()


class StreamPacker:
    """Feeds one split's token stream, slice by slice, to a ShardWriter as full chunks, each
    with the document starts inside it; `carry` is what has not filled a chunk yet."""

    def __init__(self, writer, seq_len: int, dtype):
        self.writer, self.seq_len = writer, seq_len
        self.carry = np.empty(0, dtype)
        self.pending = np.empty(0, np.int64)  # document starts in the carry, stream positions
        self.pos = 0  # tokens of the stream seen so far

    def add(self, ids: np.ndarray, starts: np.ndarray) -> None:
        """ids: the next slice of the stream; starts: sorted stream positions of document starts
        (only those inside this slice are used)."""
        a, b = np.searchsorted(starts, [self.pos, self.pos + len(ids)])
        written = self.writer.num_chunks * self.seq_len
        chunks, self.carry = packed_chunks(self.carry, ids, self.seq_len)
        all_starts = np.concatenate((self.pending, starts[a:b])) - written
        cut = np.searchsorted(all_starts, len(chunks) * self.seq_len)
        self.writer.write(chunks, doc_starts=all_starts[:cut])
        self.pending = all_starts[cut:] + written
        self.pos += len(ids)


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
