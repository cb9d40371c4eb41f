"""Packing rules and shard hashing, checked against plain re-implementations for all inputs (hypothesis)."""

import hashlib
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helixtok.format import limits
from helixtok.format import shards
from helixtok.format.bestfit import build_index, epoch_order, place
from helixtok.pipeline.pack import PACKERS, document_chunks
from helixtok.read.layout import bestfit_pieces, shuffled_documents


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
    real, started = shards.start_writeback(), []

    def start(fd, at, n, flags):
        assert os.fstat(fd).st_size >= at + n and flags == 2
        started.append((at, n))
        return real(fd, at, n, flags) if real is not None else 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(limits, "QUEUED_BYTES", queued)
        mp.setattr(shards, "WRITEBACK_BYTES", behind)
        mp.setattr(shards, "start_writeback", lambda: start)
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


def best_fit(sizes, capacity: int) -> list[list[int]]:
    """place() as lists of item numbers per bin, in bin order (each in the order placed)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    bins = place(sizes, capacity)
    out: list[list[int]] = [[] for _ in range(int(bins.max()) + 1 if len(bins) else 0)]
    for i in np.lexsort((np.arange(len(sizes)), -sizes)).tolist():
        out[bins[i]].append(i)
    return out


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


def _pack_unit(tmp, packing, docs, L, cap, min_tail, feed):
    """Feed `docs` (each with its EOS) to a packer: batches of `feed` documents, those marked
    long through the piece-by-piece path; returns (the files' bytes by kind, counts)."""
    out = PACKERS[packing](str(tmp / "u"), "train-000000", np.dtype("<u2"), L, cap, min_tail, 7)
    i = 0
    for n, long in feed:
        batch = docs[i: i + n]
        i += len(batch)
        if long and len(batch) == 1:
            out.start_long(i - 1)  # (where it was read: here its number, .src must keep it with its start)
            d = np.array(batch[0], np.uint16)
            for a in range(0, len(d), 3):  # any grouping of the ids
                out.write_long(d[a: a + 3])
            out.end_long(len(d))
        elif batch:
            out.add(np.array([t for d in batch for t in d], np.uint16), np.array([len(d) for d in batch], np.int64),
                    src=np.arange(i - len(batch), i))
    if i < len(docs):
        rest = docs[i:]
        out.add(np.array([t for d in rest for t in d], np.uint16), np.array([len(d) for d in rest], np.int64),
                src=np.arange(i, len(docs)))
    entries = out.close()
    got = {"bin": [], "docs": [], "valid": [], "src": []}
    base = 0
    for e in entries:
        assert e["num_tokens"] % (1 if packing == "packed" else L) == 0 and e["num_tokens"] <= cap
        got["bin"] += np.fromfile(tmp / e["state"], dtype="<u2").tolist()
        if "docs" in e:
            got["docs"] += (np.fromfile(tmp / e["docs"]["state"], dtype="<u8").astype(int) + base).tolist()
            assert e["docs"]["count"] * 8 == e["docs"]["bytes"]
        if "valid" in e:
            got["valid"] += np.fromfile(tmp / e["valid"]["state"], dtype="<u4").tolist()
        if "src" in e:
            got["src"] += np.fromfile(tmp / e["src"]["state"], dtype="<u4").tolist()
            assert e["src"]["bytes"] == e["docs"]["count"] * 4
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
    assert got["src"] == list(range(len(docs)))  # each document's place, beside its start, across shards
    assert got["docs"] == np.cumsum([0] + [len(d) for d in docs[:-1]]).tolist()[:len(docs)]
    min_tail = max(1, min(L, int(tail_frac * L)))
    got, c = _pack_unit(tmp, "document", docs, L, shard_chunks * L, min_tail, feed)
    rows, valid, pad, dropped, dropped_docs = reference_document(docs, L, min_tail, 7)
    assert got["bin"] == [t for r in rows for t in r] and got["valid"] == valid
    assert (c.chunks, c.pad_tokens, c.dropped_tokens, c.dropped_documents) == (len(rows), pad, dropped, dropped_docs)


def _gather(stream, lay, i, L, pad=7):
    pos, size = lay.pieces(i)
    row = [t for g, n in zip(pos, size) for t in stream[g: g + n]]
    return row + [pad] * (L - len(row))


@settings(max_examples=80, deadline=None)
@given(docs=st.lists(st.lists(st.integers(1, 60000), min_size=0, max_size=45).map(lambda d: d + [0]), max_size=40),
       L=st.integers(2, 17), min_tail=st.sampled_from([0, 0, 1, 3]), seed=st.integers(0, 3))
def test_bestfit_keeps_every_document_whole_or_in_ordered_pieces(docs, L, min_tail, seed):
    """bestfit over the whole split: every token of every kept document appears once, in order,
    within its pieces; a document of at most L tokens lies whole in one chunk; the pieces of a
    longer one are its L-token cuts, in order of the chunks; items lie back to back then padding;
    produced + pad - dropped = stored; the placement is best-fit decreasing (the plain scan's bins)
    with chunks in the order of their last item; and an epoch's order is a bijection of each
    chunk's items."""
    min_tail = min(min_tail, L)
    stream = [t for d in docs for t in d]
    lens = np.array([len(d) for d in docs], np.int64)
    pos = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64) if len(docs) else lens
    idx = build_index(pos, lens, L, min_tail)
    lay = bestfit_pieces(idx)
    rows = [_gather(stream, lay, i, L) for i in range(len(lay))]
    assert len(rows) * L == len(stream) + idx.pad_tokens - idx.dropped_tokens
    # The items a plain best-fit decreasing over the whole split makes (full pieces alone).
    items, dropped, dropped_docs = [], 0, 0
    for d in docs:
        m = len(d)
        if m - 1 < min_tail:
            dropped, dropped_docs = dropped + m, dropped_docs + 1
            continue
        pieces = [tuple(d[a: a + L]) for a in range(0, m, L)]
        if m % L and m % L < min_tail:
            dropped += m % L
            pieces = pieces[:-1]
        items += pieces
    assert (idx.dropped_tokens, idx.dropped_documents) == (dropped, dropped_docs)
    if min_tail == 0:
        assert idx.dropped_tokens == 0
    full = [k for k, it in enumerate(items) if len(it) == L]
    part = [k for k, it in enumerate(items) if len(it) < L]
    bins = [[k] for k in full] + [[part[j] for j in b] for b in reference_best_fit([len(items[k]) for k in part], L)]
    bins.sort(key=max)
    want = [[t for k in sorted(b) for t in items[k]] for b in bins]
    assert rows == [r + [7] * (L - len(r)) for r in want]
    assert sum(L - len(r) for r in want) == idx.pad_tokens
    # Item starts are the document starts of each chunk; an epoch's order moves items within chunks only.
    for i in range(len(lay)):
        assert lay.document_starts(i).tolist() == np.cumsum([0] + lay.pieces(i)[1][:-1]).tolist()
    order = epoch_order(idx, seed, 1)
    assert sorted(order.tolist()) == list(range(len(idx.pos)))
    chunk_of = np.repeat(np.arange(len(lay)), np.diff(idx.first))
    assert (chunk_of[order] == chunk_of).all()
    again = bestfit_pieces(idx, seed, 1)
    assert all(sorted(map(tuple, [stream[g: g + n] for g, n in zip(*again.pieces(i))])) ==
               sorted(map(tuple, [stream[g: g + n] for g, n in zip(*lay.pieces(i))])) for i in range(len(lay)))
    assert (again.filled == lay.filled).all()


@settings(max_examples=80, deadline=None)
@given(lens=st.lists(st.integers(1, 40), max_size=40), L=st.integers(1, 17), seed=st.integers(0, 3),
       epoch=st.integers(0, 5))
def test_an_epochs_packed_order_cuts_shuffled_documents(lens, L, seed, epoch):
    """repack (packed): the documents in the epoch's order, concatenated and cut every L tokens:
    as many chunks as the stored order, each document's tokens once and in order, document starts
    exactly where the shuffled stream has them."""
    stream, docs, at = [], [], 0
    for k, n in enumerate(lens):
        docs.append(list(range(at, at + n)))
        at += n
    stream = [t for d in docs for t in d]
    lens = np.array(lens, np.int64)
    pos = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64) if len(lens) else lens
    lay = shuffled_documents(pos, lens, L, seed, epoch)
    assert len(lay) == len(stream) // L
    perm = np.random.default_rng([seed, 0, epoch]).permutation(len(docs))
    flat = [t for k in perm for t in docs[k]]
    starts = set(np.cumsum([0] + [len(docs[k]) for k in perm[:-1]]).tolist()) if len(docs) else set()
    for i in range(len(lay)):
        assert _gather(stream, lay, i, L) == flat[i * L: (i + 1) * L]
        assert lay.document_starts(i).tolist() == sorted(s - i * L for s in starts if i * L <= s < (i + 1) * L)
        assert lay.filled[i] == L