"""Packing rules and shard hashing, checked against plain re-implementations for all inputs (hypothesis)."""

import hashlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helixtok import shards
from helixtok.pack import PACKERS, best_fit, document_chunks


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


def test_document_chunks_hand_made():
    # doc A: 5 ids + EOS = 6 -> one full chunk of 4, tail 2 >= 1 -> padded; doc B: 1 id < 2 -> dropped
    ids = np.array([1, 2, 3, 4, 5, 0, 9, 0], dtype=np.uint16)
    chunks, valid, c = document_chunks(ids, np.array([6, 2]), 4, 2, 8)
    assert chunks.tolist() == [[1, 2, 3, 4], [5, 0, 8, 8]]
    assert valid.tolist() == [4, 2]
    assert (c.pad_tokens, c.dropped_tokens, c.dropped_documents) == (2, 2, 1)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 50000), max_size=25), queued=st.integers(1, 90000),
       behind=st.integers(1, 300000))
def test_shard_hash_behind_the_writes_is_the_files_sha256(tmp_path_factory, sizes, queued, behind):
    """A shard's sha256 is hashed in a thread beside the writes (small buffers inline), holding
    at most `queued` bytes not yet hashed: the commit gives exactly hashlib's digest of the bytes
    in order, and the file holds them under its final name.  Write-back is started (Linux) over
    consecutive ranges of at least `behind` bytes, each already in the file when started."""
    d = tmp_path_factory.mktemp("sha")
    rng = np.random.default_rng(len(sizes))
    real, started = shards._start_writeback(), []

    def start(fd, at, n, flags):
        assert os.fstat(fd).st_size >= at + n and flags == 2
        started.append((at, n))
        return real(fd, at, n, flags) if real is not None else 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(shards._Sha256Behind, "QUEUED_BYTES", queued)
        mp.setattr(shards, "WRITEBACK_BYTES", behind)
        mp.setattr(shards, "_start_writeback", lambda: start)
        f = shards.HashedFile(str(d / "s.bin"))
        want, seen = hashlib.sha256(), b""
        for i, n in enumerate(sizes):
            arr = rng.integers(0, 2**32, size=n, dtype=np.uint32)
            if i % 3 == 0:
                arr = arr[::2]  # strided too: written as its contiguous copy
            f.write(arr)
            want.update(arr.tobytes())
            seen += arr.tobytes()
        entry = f.commit()
    assert entry == {"bytes": len(seen), "sha256": want.hexdigest()}
    assert (d / "s.bin").read_bytes() == seen
    ends = [at + n for at, n in started]
    assert [at for at, _ in started] == ([0] + ends[:-1] if started else []) and all(n >= behind for _, n in started)
    assert len(seen) - (ends[-1] if ends else 0) < behind  # all but the last `behind` bytes are on their way
    assert not os.path.exists(shards._tmp_of(str(d / "s.bin")))


def test_best_fit_hand_made():
    assert best_fit([3, 2, 2, 1], 4) == [[0, 3], [1, 2]]
    assert best_fit([4, 4, 1], 4) == [[0], [1], [2]]
    assert best_fit([], 8) == []
    # 5 goes with the 3 that leaves 0 room, not the first bin with room (first fit would pick the 4)
    assert best_fit([6, 5, 3, 2], 8) == [[0, 3], [1, 2]]


def reference_best_fit(sizes, cap):
    """Best-fit decreasing the plain way: scan every bin for the tightest fit (ties: the lower bin)."""
    bins, room = [], []
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        fits = [(room[b] - sizes[i], b) for b in range(len(bins)) if room[b] >= sizes[i]]
        if fits:
            _, b = min(fits)
            bins[b].append(i)
            room[b] -= sizes[i]
        else:
            bins.append([i])
            room.append(cap - sizes[i])
    return bins


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), max_size=60), cap=st.integers(40, 64))
def test_best_fit_matches_the_plain_scan(sizes, cap):
    got = best_fit(sizes, cap)
    assert got == reference_best_fit(sizes, cap)
    assert sorted(i for b in got for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= cap for b in got)


def _pack_unit(tmp, packing, docs, L, cap, min_tail, feed, window=None):
    """Feed `docs` (each with its EOS) to a packer: batches of `feed` documents, those marked
    long through the piece-by-piece path; returns (the files' bytes by kind, counts)."""
    kw = {"window": window} if packing == "bestfit" else {}
    out = PACKERS[packing](str(tmp / "u"), "train-000000", np.dtype("<u2"), L, cap, min_tail, 7, **kw)
    i = 0
    for n, long in feed:
        batch = docs[i: i + n]
        i += len(batch)
        if long and len(batch) == 1:
            out.start_long()
            d = np.array(batch[0], np.uint16)
            for a in range(0, len(d), 3):  # any grouping of the ids
                out.write_long(d[a: a + 3])
            out.end_long(len(d))
        elif batch:
            out.add(np.array([t for d in batch for t in d], np.uint16), np.array([len(d) for d in batch], np.int64))
    if i < len(docs):
        rest = docs[i:]
        out.add(np.array([t for d in rest for t in d], np.uint16), np.array([len(d) for d in rest], np.int64))
    entries = out.close()
    got = {"bin": [], "docs": [], "valid": []}
    base = 0
    for e in entries:
        assert e["num_tokens"] % (1 if packing == "packed" else L) == 0 and e["num_tokens"] <= cap
        got["bin"] += np.fromfile(tmp / e["state"], dtype="<u2").tolist()
        if "docs" in e:
            got["docs"] += (np.fromfile(tmp / e["docs"]["state"], dtype="<u8").astype(int) + base).tolist()
            assert e["docs"]["count"] * 8 == e["docs"]["bytes"]
        if "valid" in e:
            got["valid"] += np.fromfile(tmp / e["valid"]["state"], dtype="<u4").tolist()
        assert hashlib.sha256((tmp / e["state"]).read_bytes()).hexdigest() == e["sha256"]
        base += e["num_tokens"]
    for f in tmp.iterdir():
        f.unlink()
    return got, out.counts


unit_docs = st.lists(st.lists(st.integers(1, 60000), min_size=0, max_size=45).map(lambda d: d + [0]), max_size=25)
feeds = st.lists(st.tuples(st.integers(0, 4), st.booleans()), max_size=12)


@settings(max_examples=50, deadline=None)
@given(docs=unit_docs, L=st.integers(1, 17), shard_chunks=st.integers(1, 5), feed=feeds, tail_frac=st.floats(0, 1))
def test_packed_and_document_units_store_the_rule_in_any_feed(tmp_path_factory, docs, L, shard_chunks, feed,
                                                              tail_frac):
    """packed: a unit's shards are its stream, with every document start; document: the chunks
    of docs/format.md's rule.  The same bytes however the documents arrive (batches, or a long
    document's ids in pieces) and whatever the shard size."""
    tmp = tmp_path_factory.mktemp("u")
    stream = [t for d in docs for t in d]
    got, _ = _pack_unit(tmp, "packed", docs, L, shard_chunks * L, 0, feed)
    assert got["bin"] == stream
    assert got["docs"] == np.cumsum([0] + [len(d) for d in docs[:-1]]).tolist()[:len(docs)]
    min_tail = max(1, min(L, int(tail_frac * L)))
    got, c = _pack_unit(tmp, "document", docs, L, shard_chunks * L, min_tail, feed)
    rows, valid, pad, dropped, dropped_docs = reference_document(docs, L, min_tail, 7)
    assert got["bin"] == [t for r in rows for t in r] and got["valid"] == valid
    assert (c.chunks, c.pad_tokens, c.dropped_tokens, c.dropped_documents) == (len(rows), pad, dropped, dropped_docs)


@settings(max_examples=80, deadline=None)
@given(docs=unit_docs, L=st.integers(2, 17), shard_chunks=st.integers(1, 5), feed=feeds,
       window=st.sampled_from([1, 16, 64, 1 << 20]), min_tail=st.sampled_from([0, 0, 1, 3]))
def test_bestfit_keeps_every_document_whole_or_in_ordered_pieces(tmp_path_factory, docs, L, shard_chunks, feed,
                                                                 window, min_tail):
    """bestfit: every token of every kept document appears once, in order, within its pieces; a
    document of at most L tokens lies whole in one chunk; the pieces of a longer one are its
    L-token cuts, in order; chunks hold items back to back (.docs at each item's start, .valid
    their total) then padding; produced + pad - dropped = stored; and the bytes do not depend
    on how the documents are batched."""
    min_tail = min(min_tail, L)
    tmp = tmp_path_factory.mktemp("u")
    got, c = _pack_unit(tmp, "bestfit", docs, L, shard_chunks * L, min_tail, feed, window)
    # A document read in pieces closes the window before it (which documents are is a function
    # of the input: their size): the same long ones, the others one by one, give the same bytes.
    singly, i = [], 0
    for n, long in feed:
        n = min(n, len(docs) - i)
        singly += [(1, long)] if long and n == 1 else [(1, False)] * n
        i += n
    again, _ = _pack_unit(tmp, "bestfit", docs, L, shard_chunks * L, min_tail, singly, window)
    assert got == again
    ids, valid, starts = got["bin"], got["valid"], got["docs"]
    assert len(ids) == len(valid) * L == c.chunks * L
    assert sum(len(d) for d in docs) + c.pad_tokens - c.dropped_tokens == len(ids)
    # Cut the chunks into items at .docs, up to .valid; the rest of each chunk is padding.
    items = []
    for r, v in enumerate(valid):
        assert 1 <= v <= L and all(t == 7 for t in ids[r * L + v: (r + 1) * L])
        cuts = [s - r * L for s in starts if r * L <= s < r * L + v]
        assert cuts and cuts[0] == 0
        items += [tuple(ids[r * L + a: r * L + b]) for a, b in zip(cuts, cuts[1:] + [v])]
    assert all(r * L <= s < r * L + valid[r] for s in starts for r in [s // L])
    # Each kept document's pieces, found in order of the chunks.
    pos = 0
    dropped = dropped_docs = 0
    for d in docs:
        m = len(d)
        if m - 1 < min_tail:
            dropped, dropped_docs = dropped + m, dropped_docs + 1
            continue
        pieces = [tuple(d[a: a + L]) for a in range(0, m, L)]
        if m % L and m % L < min_tail:
            dropped += m % L
            pieces = pieces[:-1]
        for p in pieces:
            k = items.index(p, pos) if p in items[pos:] else items.index(p)
            items[k] = None  # each item is used once
        pos = 0
    assert all(x is None for x in items)
    assert (c.dropped_tokens, c.dropped_documents) == (dropped, dropped_docs)
    if min_tail == 0:
        assert c.dropped_tokens == 0
    # Pieces of one document: in order (by where they lie), each one whole in a chunk.
    for d in docs:
        if len(d) > L:
            found = [i for i in range(0, len(ids) - L + 1, L) if tuple(ids[i: i + L]) == tuple(d[:L])]
            assert found
