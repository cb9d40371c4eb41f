"""Packing rules, checked against a plain re-implementation for all inputs (hypothesis)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from helixtok.pack import document_chunks, packed_chunks


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


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.lists(st.integers(0, 65535), max_size=50), max_size=20), L=st.integers(1, 33))
def test_packed_chunks_concatenate_and_cut(pieces, L):
    carry = np.empty(0, np.uint16)
    out = []
    for p in pieces:
        chunks, carry = packed_chunks(carry, np.array(p, dtype=np.uint16), L)
        assert chunks.shape[1:] == (L,)
        out.extend(chunks.tolist())
        assert len(carry) < L
    stream = [t for p in pieces for t in p]
    k = len(stream) // L
    assert out == [stream[i * L:(i + 1) * L] for i in range(k)]
    assert carry.tolist() == stream[k * L:]


def test_document_chunks_hand_made():
    # doc A: 5 ids + EOS = 6 -> one full chunk of 4, tail 2 >= 1 -> padded; doc B: 1 id < 2 -> dropped
    ids = np.array([1, 2, 3, 4, 5, 0, 9, 0], dtype=np.uint16)
    chunks, valid, c = document_chunks(ids, np.array([6, 2]), 4, 2, 8)
    assert chunks.tolist() == [[1, 2, 3, 4], [5, 0, 8, 8]]
    assert valid.tolist() == [4, 2]
    assert (c.pad_tokens, c.dropped_tokens, c.dropped_documents) == (2, 2, 1)
