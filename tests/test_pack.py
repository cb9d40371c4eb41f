"""Packing rules and shard hashing, checked against plain re-implementations for all inputs (hypothesis)."""

import hashlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helixtok import shards
from helixtok.pack import StreamPacker, document_chunks


def reference_document(docs, L, min_tail, pad):
    """The rule of docs/format.md, one document at a time, in plain Python."""
    rows, valid, pad_n, dropped, dropped_docs = [], [], 0, 0, 0
    for d in docs:  # d includes its EOS
        n = len(d) - 1
        if n < min_tail:
            dropped += len(d)
            dropped_docs += 1
            continue
        full, r = divmod(len(d), L)
        for k in range(full):
            rows.append(d[k * L:(k + 1) * L])
            valid.append(L)
        if r >= min_tail:
            rows.append(d[full * L:] + [pad] * (L - r))
            valid.append(r)
            pad_n += L - r
        else:
            dropped += r
    return rows, valid, pad_n, dropped, dropped_docs


docs_st = st.lists(st.lists(st.integers(1, 60000), min_size=0, max_size=40).map(lambda d: d + [0]),
                   min_size=0, max_size=30)


@settings(max_examples=300, deadline=None)
@given(docs=docs_st, L=st.integers(1, 17), tail_frac=st.floats(0, 1))
def test_document_chunks_match_reference(docs, L, tail_frac):
    min_tail = max(1, min(L, int(tail_frac * L)))
    ids = np.array([t for d in docs for t in d], dtype=np.uint16)
    lens = np.array([len(d) for d in docs], dtype=np.int64)
    chunks, valid, c = document_chunks(ids, lens, L, min_tail, 7)
    rows, rvalid, rpad, rdrop, rdd = reference_document(docs, L, min_tail, 7)
    assert chunks.tolist() == rows
    assert valid.tolist() == rvalid
    assert (c.pad_tokens, c.dropped_tokens, c.dropped_documents, c.chunks) == (rpad, rdrop, rdd, len(rows))
    # Nothing is lost unaccounted: produced + padding - dropped = stored.
    assert len(ids) + c.pad_tokens - c.dropped_tokens == c.chunks * L


class _Recorder:
    """The ShardWriter interface StreamPacker uses: keeps chunks and absolute document starts."""

    def __init__(self, L):
        self.L, self.num_chunks, self.rows, self.starts = L, 0, [], []

    def write(self, chunks, doc_starts):
        assert chunks.ndim == 2 and chunks.shape[1] == self.L
        assert all(0 <= s < len(chunks) * self.L for s in doc_starts.tolist())
        self.starts += [self.num_chunks * self.L + s for s in doc_starts.tolist()]
        self.rows += chunks.tolist()
        self.num_chunks += len(chunks)


@settings(max_examples=300, deadline=None)
@given(docs=st.lists(st.lists(st.integers(0, 65535), min_size=1, max_size=50), max_size=20),
       L=st.integers(1, 33), slices=st.lists(st.integers(0, 70), max_size=40))
def test_stream_packer_cuts_the_stream_and_keeps_document_starts(docs, L, slices):
    """Fed in any slicing, the chunks are the stream cut every L tokens, the carry is the rest,
    and the document starts written are exactly those inside full chunks."""
    stream = [t for d in docs for t in d]
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]]).astype(np.int64) if docs else np.empty(0, np.int64)
    rec = _Recorder(L)
    packer = StreamPacker(rec, L, np.uint16)
    arr, i = np.array(stream, dtype=np.uint16), 0
    for n in slices + [len(stream)]:
        packer.add(arr[i: i + n], starts)
        i = min(len(stream), i + n)
    k = len(stream) // L
    assert rec.rows == [stream[j * L:(j + 1) * L] for j in range(k)]
    assert packer.carry.tolist() == stream[k * L:]
    assert rec.starts == [s for s in starts.tolist() if s < k * L]


def test_document_chunks_hand_made():
    # doc A: 5 ids + EOS = 6 -> one full chunk of 4, tail 2 >= 1 -> padded; doc B: 1 id < 2 -> dropped
    ids = np.array([1, 2, 3, 4, 5, 0, 9, 0], dtype=np.uint16)
    chunks, valid, c = document_chunks(ids, np.array([6, 2]), 4, 2, 8)
    assert chunks.tolist() == [[1, 2, 3, 4], [5, 0, 8, 8]]
    assert valid.tolist() == [4, 2]
    assert (c.pad_tokens, c.dropped_tokens, c.dropped_documents) == (2, 2, 1)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), max_size=25), marks=st.sets(st.integers(0, 25)),
       queued=st.integers(1, 9000))
def test_shard_hash_behind_the_writes_is_the_files_sha256(tmp_path_factory, sizes, marks, queued):
    """The shard's sha256 is hashed in a thread beside the writes, holding at most `queued`
    bytes not yet hashed: every mark and the commit give exactly hashlib's digest of the bytes
    so far, in order, and the file holds them; a writer reopened at a mark goes on to the same."""
    d = tmp_path_factory.mktemp("sha")
    rng = np.random.default_rng(len(sizes))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shards._Sha256Behind, "QUEUED_BYTES", queued)
        f = shards._HashedFile(str(d / "s.bin"))
        want, seen, at_mark = hashlib.sha256(), b"", None
        for i, n in enumerate(sizes):
            arr = rng.integers(0, 2**32, size=n, dtype=np.uint32)
            if i % 3 == 0:
                arr = arr[::2]  # strided too: written as its contiguous copy
            f.write(arr)
            want.update(arr.tobytes())
            seen += arr.tobytes()
            if i in marks:
                at_mark = (f.mark(), seen)
                assert at_mark[0] == [len(seen), want.hexdigest()]
        if at_mark is not None:  # stopped there, then reopened at the mark: same bytes, same hash
            f.close()
            f = shards._HashedFile.reopen(str(d / "s.bin"), at_mark[0])
            want, seen = hashlib.sha256(at_mark[1]), at_mark[1]
            tail = rng.integers(0, 2**32, size=777, dtype=np.uint32)
            f.write(tail)
            want.update(tail.tobytes())
            seen += tail.tobytes()
        entry = f.commit()
    assert entry == {"path": "s.bin", "bytes": len(seen), "sha256": want.hexdigest()}
    assert (d / "s.bin").read_bytes() == seen
    assert not os.path.exists(shards._tmp_of(str(d / "s.bin")))
