"""ChunkSampler and MixtureDataset: bijection, exact lengths, disjoint ranks, exact mid-epoch resume."""

import multiprocessing as mp
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from helixtok import ChunkSampler, MemmapChunkDataset, MixtureDataset
from helixtok.format.errors import ConfigError
from helixtok.read.sampler import Permutation
from helixtok.read.stats import batches_per_epoch, samples_per_rank


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**40), epoch=st.integers(0, 1000))
def test_permutation_is_a_bijection(n, seed, epoch):
    p = Permutation(n, seed=seed, epoch=epoch)(np.arange(n))
    assert np.array_equal(np.sort(p), np.arange(n))


def test_permutation_depends_on_seed_and_epoch_only():
    a = Permutation(1000, seed=1, epoch=0)(np.arange(1000))
    assert np.array_equal(a, Permutation(1000, seed=1, epoch=0)(np.arange(1000)))
    assert not np.array_equal(a, Permutation(1000, seed=1, epoch=1)(np.arange(1000)))
    assert not np.array_equal(a, Permutation(1000, seed=2, epoch=0)(np.arange(1000)))
    assert not np.array_equal(a, np.arange(1000))


@pytest.mark.parametrize("n", [1, 5, 97, 1000])
@pytest.mark.parametrize("W", [1, 2, 3, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_disjoint_cover_and_len_equals_stats(n, W, drop_last):
    ranks = [list(ChunkSampler(range(n), seed=5, rank=r, world_size=W, drop_last=drop_last)) for r in range(W)]
    per = samples_per_rank(n, W, drop_last)
    assert all(len(r) == per for r in ranks)
    flat = [i for r in ranks for i in r]
    if drop_last:
        assert len(set(flat)) == len(flat) == per * W  # disjoint, nothing repeated
    else:
        assert set(flat) == set(range(n))  # every chunk once, plus the wrap-around padding
        assert len(flat) - n == per * W - n
    for B in (1, 4, 16):
        s = ChunkSampler(range(n), rank=0, world_size=W, drop_last=drop_last)
        assert len(DataLoader(range(n), batch_size=B, sampler=s, drop_last=drop_last)) == \
            batches_per_epoch(n, B, W, drop_last)


def _rank_indices(args):
    n, r, W, epoch = args
    s = ChunkSampler(range(n), seed=11, rank=r, world_size=W, drop_last=True)
    s.set_epoch(epoch)
    return list(s)


@pytest.fixture(scope="module")
def rank_pool():
    """Two spawned processes for the tests of ranks in separate processes (ranks take turns in
    them: each computes its slice apart from the test's process, from (seed, epoch) alone):
    shared, as each costs ~1.5 s of imports (torch) to start, and two, as each holds ~170 MB."""
    with mp.get_context("spawn").Pool(2) as pool:
        yield pool


def test_multi_process_ranks_agree_without_communication(rank_pool):
    """Ranks in separate processes compute their slices from (seed, epoch) alone: disjoint, covering."""
    n, W = 10_007, 4
    orders = []
    for epoch in (0, 1):
        parts = rank_pool.map(_rank_indices, [(n, r, W, epoch) for r in range(W)])
        flat = [i for p in parts for i in p]
        assert len(flat) == len(set(flat)) == (n // W) * W
        assert parts[0] == _rank_indices((n, 0, W, epoch))  # the same slice in any process
        orders.append(flat)
    assert orders[0] != orders[1]  # set_epoch reshuffles


@pytest.mark.parametrize("workers_before, workers_after", [(0, 2), (2, 0)])
def test_resume_mid_epoch_at_the_exact_next_sample(dev_packed, workers_before, workers_after):
    ds = MemmapChunkDataset(dev_packed)
    B = 32

    def loader(sampler, nw):
        return DataLoader(ds, batch_size=B, sampler=sampler, num_workers=nw)

    full = ChunkSampler(ds, seed=3, rank=1, world_size=2)
    full.set_epoch(2)
    want = [b["input_ids"][:, 0].tolist() for b in loader(full, 0)]

    s = ChunkSampler(ds, seed=3, rank=1, world_size=2)
    s.set_epoch(2)
    got = []
    for i, b in enumerate(loader(s, workers_before)):
        got.append(b["input_ids"][:, 0].tolist())
        if i == 9:
            state = s.state_dict(samples_consumed=(i + 1) * B)
            break
    s2 = ChunkSampler(ds, seed=3, rank=1, world_size=2)
    s2.load_state_dict(state)
    assert len(loader(s2, workers_after)) == len(want) - 10
    got += [b["input_ids"][:, 0].tolist() for b in loader(s2, workers_after)]
    assert got == want
    assert len(s2) == s2.num_samples  # the offset applied to the resumed epoch only


def _rank_run(args):
    """One rank in its own process: consume `steps` batches (or all), return them and the state."""
    n, W, r, B, steps, state = args
    s = ChunkSampler(range(n), seed=5, rank=r, world_size=W)
    if state is not None:
        s.load_state_dict(state)
    order = list(s)
    take = order if steps is None else order[: steps * B]
    return take, s.state_dict(len(take)) if steps is not None else None, len(s)


@pytest.mark.parametrize("W1,W2", [(2, 3), (4, 2)])
def test_elastic_resume_on_another_world_size_loses_and_repeats_nothing(rank_pool, W1, W2):
    GB, n, steps = 12, 1000, 7  # a fixed global batch: per-rank B = GB / W
    before = rank_pool.map(_rank_run, [(n, W1, r, GB // W1, steps, None) for r in range(W1)])
    state = before[0][1]
    assert state["global_consumed"] == steps * GB and all(b[1]["global_consumed"] == steps * GB for b in before)
    after = rank_pool.map(_rank_run, [(n, W2, r, GB // W2, None, state) for r in range(W2)])
    seen = [i for take, _, _ in before for i in take]
    rest = [i for take, _, _ in after for i in take]
    assert len(seen) == steps * GB and len(set(seen)) == len(seen)
    # The rest of the epoch: every sample not yet seen, once (plus DistributedSampler-style padding).
    assert set(seen) | set(rest) == set(range(n)) and not set(seen) & set(rest)
    assert len(rest) - len(set(rest)) < W2
    assert all(lens == after[0][2] for _, _, lens in after)  # len(sampler) after loading, equal on every rank
    # With a fixed global batch, the global batches after the resume hold what they would have held.
    full = [_rank_run((n, W1, r, GB // W1, None, None))[0] for r in range(W1)]
    for k in range(steps, steps + 10):
        old = {i for f in full for i in f[k * (GB // W1): (k + 1) * (GB // W1)]}
        new = {i for take, _, _ in after for i in take[(k - steps) * (GB // W2): (k - steps + 1) * (GB // W2)]}
        assert old == new, k


def test_same_world_size_resume_still_refuses_another_seed():
    s = ChunkSampler(range(100), world_size=2, seed=1)
    with pytest.raises(ConfigError, match="seed=1"):
        ChunkSampler(range(100), world_size=2, seed=2).load_state_dict(s.state_dict(10))


def test_mixture_exact_counts_and_items(dev_packed, dev_document):
    a, b = MemmapChunkDataset(dev_packed), MemmapChunkDataset(dev_document)
    mix = MixtureDataset([a, b], weights=[3, 1], batch_size=8)
    assert len(mix) == int(len(a) / 0.75)  # a is the binding source: used exactly once per epoch
    assert mix.counts.tolist() == [len(a), len(mix) - len(a)]
    firsts = [mix.locate(i) for i in range(len(mix))]
    assert sorted(j for s, j in firsts if s == 0) == list(range(len(a)))  # a bijection of source a
    s, j = mix.locate(0)
    assert torch.equal(mix[0]["input_ids"], (a, b)[s][j]["input_ids"])
    assert len(DataLoader(mix, batch_size=7)) == -(-len(mix) // 7)
    with pytest.raises(ConfigError):
        MixtureDataset([a, b], weights=[1])


@pytest.mark.parametrize("weights,B", [([0.7, 0.3], 10), ([0.5, 0.3, 0.2], 7), ([0.9, 0.1], 32), ([1, 1, 1], 5)])
def test_mixture_proportions_hold_per_batch_and_every_prefix(weights, B):
    srcs = [list(range(n)) for n in (1000, 777, 555)[: len(weights)]]
    mix = MixtureDataset(srcs, weights=weights, batch_size=B, num_samples=2000)
    w = np.asarray(weights, float) / sum(weights)
    src = np.array([mix.locate(i)[0] for i in range(len(mix))])
    for k in range(0, len(mix) - B + 1, B):  # each global batch: within 1 of weight x B
        got = np.bincount(src[k: k + B], minlength=len(w))
        assert (np.abs(got - w * B) < 1 + 1e-9).all(), (k, got, w * B)
        pre = np.bincount(src[: k + B], minlength=len(w))
        assert (np.abs(pre - w * (k + B)) <= 1 + 1e-9).all()
    assert np.bincount(src, minlength=len(w)).tolist() == mix.counts.tolist()


def test_mixture_uses_every_chunk_of_a_down_weighted_source_before_repeating():
    """The issue's case, scaled: weights [0.7, 0.3] over 17,357 and 19,272 chunks read j % len
    used only chunks 0..7,437 of the second source in every epoch."""
    a, b = list(range(1736)), list(range(1927))
    mix = MixtureDataset([a, b], weights=[0.7, 0.3], batch_size=16, seed=3)
    per_epoch = int(mix.counts[1])
    assert per_epoch < len(b)
    seen = []
    for e in range(-(-len(b) // per_epoch) + 1):
        mix.set_epoch(e)
        seen += [j for s, j in (mix.locate(i) for i in range(len(mix))) if s == 1]
    assert sorted(seen[: len(b)]) == b  # every chunk once before any repeat, across epochs
    assert len(set(seen[len(b): 2 * len(b)])) == len(seen[len(b): 2 * len(b)])  # the next pass too
    # Exact resume: a fresh mixture loaded from the state gives the same samples.
    mix.set_epoch(2)
    state = mix.state_dict()
    other = MixtureDataset([a, b], weights=[0.7, 0.3], batch_size=16, seed=3)
    other.load_state_dict(state)
    assert [other.locate(i) for i in range(100)] == [mix.locate(i) for i in range(100)]
    with pytest.raises(ConfigError, match="batch_size"):
        MixtureDataset([a, b], weights=[0.7, 0.3], batch_size=8, seed=3).load_state_dict(state)


def test_malformed_sampler_states_are_one_config_error():
    """load_state_dict checks the state's shape: a bare KeyError, numpy's ValueError, or a state
    with world_size 0 or a position past the epoch (accepted before) is one ConfigError."""
    s = ChunkSampler(range(100), seed=2, world_size=2, rank=1)
    good = s.state_dict(10)
    bad = [None, [], {}, {k: v for k, v in good.items() if k != "epoch"}, {**good, "world_size": 0},
           {**good, "offset": 51}, {**good, "offset": -1}, {**good, "epoch": "1"}, {**good, "rank": 2},
           {**good, "global_consumed": 101}, {**good, "drop_last": 0}, {**good, "seed": 2.0}, {**good, "base": 500}]
    for state in bad:
        with pytest.raises(ConfigError, match="sampler state"):
            ChunkSampler(range(100), seed=2, world_size=2, rank=1).load_state_dict(state)
    t = ChunkSampler(range(100), seed=2, world_size=2, rank=1)
    t.load_state_dict(good)  # and the real one still loads
    assert list(t) == list(s)[10:]


@pytest.mark.parametrize("packing", ["packed", "bestfit"])
def test_a_new_packing_every_epoch_through_dataloader_workers_and_a_resume(dev_packed, dev_bestfit, packing):
    """repack=True: ChunkSampler hands the epoch with each index, so persistent DataLoader workers
    read each epoch's own packing without set_epoch; len() is the same every epoch; packed: the
    epoch's chunks are its shuffled documents cut every seq_len (each document's tokens once, in
    order); bestfit: each chunk holds the same items, in a new order; a resume mid-epoch with
    another worker count gives the exact rest of that epoch."""
    from helixtok.read.splitview import SplitView

    out = dev_packed if packing == "packed" else dev_bestfit
    ds = MemmapChunkDataset(out, repack=True, seed=9, position_ids=True)
    n, L = len(ds), ds.seq_len
    sampler = ChunkSampler(ds, seed=4)
    dl = DataLoader(ds, batch_size=64, sampler=sampler, num_workers=2, persistent_workers=True, collate_fn=ds.collate)
    by_epoch = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        rows = {}
        order = sampler.indices().tolist()
        for k, b in enumerate(dl):
            for j, row in enumerate(b["input_ids"].numpy()):
                rows[order[k * 64 + j]] = row
        assert len(dl) * 64 >= len(rows) == n  # every chunk of the epoch once
        by_epoch.append(np.stack([rows[i] for i in range(n)]))
    assert not np.array_equal(by_epoch[0], by_epoch[1])
    m = ds.manifest
    if packing == "packed":
        lens = SplitView(out, m).document_lengths()
        stream = np.concatenate([np.fromfile(os.path.join(out, e["path"]), dtype="<u2") for e in m["splits"]["train"]["shards"]])
        starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
        for epoch, got in enumerate(by_epoch):
            perm = np.random.default_rng([9, 0, epoch]).permutation(len(lens))
            flat = np.concatenate([stream[starts[d]: starts[d] + lens[d]] for d in perm])
            assert np.array_equal(got.reshape(-1), flat[: n * L])
            # position ids restart exactly where a shuffled document starts
            d0 = ds[(epoch, 0)]["position_ids"].numpy()
            cut = np.cumsum(lens[perm])
            assert np.flatnonzero(d0 == 0).tolist() == [0] + [int(c) for c in cut[cut < L]]
            # shifted=True: the last label of chunk i is the first token of the epoch's chunk i + 1
            sh = MemmapChunkDataset(out, repack=True, seed=9, shifted=True)
            for i in (0, n // 2, n - 2):
                assert sh[(epoch, i)]["labels"].tolist() == flat[i * L + 1: (i + 1) * L + 1].tolist()
            assert sh[(epoch, n - 1)]["labels"][-1] == -100
    else:
        fixed = MemmapChunkDataset(out)
        stored = np.stack([fixed[i]["input_ids"].numpy() for i in range(n)])
        for got in by_epoch:
            assert (np.sort(got, axis=1) == np.sort(stored, axis=1)).all()
    # A resume in the middle of epoch 1 (2 workers before, none after) reads the rest exactly.
    sampler.set_epoch(1)
    it = iter(dl)
    head = [next(it)["input_ids"] for _ in range(5)]
    state = sampler.state_dict(samples_consumed=5 * 64)
    del it
    s2 = ChunkSampler(MemmapChunkDataset(out, repack=True, seed=9), seed=4)
    s2.load_state_dict(state)
    rest = [b["input_ids"] for b in DataLoader(ds, batch_size=64, sampler=s2, collate_fn=ds.collate)]
    got = torch.cat(head + rest).numpy()
    assert np.array_equal(got, by_epoch[1][sampler.indices()])


class _Blocks:
    """A sized stand-in that says which chunks each block holds (what MemmapChunkDataset.block_of_chunks gives)."""

    def __init__(self, bounds):
        self.bounds, self.n = bounds, int(bounds[-1])

    def __len__(self):
        return self.n

    def block_of_chunks(self):
        return self.bounds, None


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 30), min_size=1, max_size=25), nodes=st.integers(1, 3), rpn=st.integers(1, 3),
       window=st.integers(1, 4), drop=st.booleans(), seed=st.integers(0, 5), cut=st.integers(0, 40),
       new_world=st.integers(1, 5))
def test_block_shuffle_covers_the_epoch_keeps_nodes_apart_and_resumes(sizes, nodes, rpn, window, drop, seed, cut,
                                                                      new_world):
    """For any blocks, nodes, ranks per node, window and drop_last: ranks get equal counts that
    cover the epoch (padding only as DistributedSampler pads); a node's ranks read a contiguous
    share of the block order (nodes share only the blocks at their shares' edges); a resume on
    the same layout goes on exactly, an elastic one with exactly the positions not yet read."""
    bounds = np.concatenate(([0], np.cumsum(sizes)))
    ds, n, world = _Blocks(bounds), int(bounds[-1]), nodes * rpn
    if n == 0:
        return

    def sampler(r, w, **kw):
        return ChunkSampler(ds, seed=seed, shuffle="block", window=window, rank=r, world_size=w, drop_last=drop, **kw)

    lists = [list(sampler(r, world, ranks_per_node=rpn)) for r in range(world)]
    per = len(lists[0])
    assert all(len(x) == per for x in lists)
    every = [c for x in lists for c in x]
    if drop:
        assert len(set(every)) == len(every) == world * (n // world)
    else:
        assert set(every) == set(range(n)) and len(every) - n < world
    block = lambda c: int(np.searchsorted(bounds, c, side="right") - 1)  # noqa: E731
    node_blocks = [{block(c) for r in range(j * rpn, (j + 1) * rpn) for c in lists[r]} for j in range(nodes)]
    for a in range(nodes):
        for b in range(a + 1, nodes):
            assert len(node_blocks[a] & node_blocks[b]) <= 2 * window + 2
    c = min(cut, per)
    state = sampler(0, world, ranks_per_node=rpn).state_dict(c)
    for r in range(world):
        t = sampler(r, world, ranks_per_node=rpn)
        t.load_state_dict({**state, "rank": r})
        assert list(t) == lists[r][c:]
    rest = [x for r in range(world) for x in lists[r][c:]]
    if new_world != world:
        elastic = []
        for r in range(new_world):
            t = sampler(r, new_world)
            t.load_state_dict({**state, "rank": 0})
            elastic += list(t)
        if drop:  # drop_last may leave up to a rank's worth out, as it does when the epoch starts
            assert set(elastic) <= set(rest) and len(elastic) >= len(rest) - new_world
        else:
            assert set(elastic) == set(rest)


@pytest.mark.parametrize("nw", [0, 2, 4])
def test_statefuldataloader_resumes_each_rank_at_the_exact_next_sample(dev_packed, nw):
    """Issue 56.5: torchdata's StatefulDataLoader over MemmapChunkDataset + ChunkSampler, stopped after
    7 batches and resumed from its own state_dict() in a new loader and sampler: the rest equals an
    uninterrupted run's, on each of 2 ranks; the two ranks' runs hold every chunk of the epoch once."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    ds = MemmapChunkDataset(dev_packed)
    B = 16

    def loader(rank, state=None):
        s = ChunkSampler(ds, seed=7, rank=rank, world_size=2, drop_last=True)
        s.set_epoch(1)
        dl = StatefulDataLoader(ds, batch_size=B, sampler=s, num_workers=nw)
        if state is not None:
            dl.load_state_dict(state)
        return dl

    rows = []
    for rank in (0, 1):
        want = [b["input_ids"].numpy() for b in loader(rank)]
        dl, got = loader(rank), []
        for k, b in enumerate(dl):
            got.append(b["input_ids"].numpy())
            if k == 6:
                state = dl.state_dict()
                break
        del dl
        got += [b["input_ids"].numpy() for b in loader(rank, state)]
        assert len(got) == len(want) and all(np.array_equal(a, b) for a, b in zip(got, want))
        rows.append(np.concatenate(want))
    every = np.stack([ds[i]["input_ids"].numpy() for i in range(len(ds) - len(ds) % 2)])
    both = np.concatenate(rows)
    assert len(both) == len(every)
    assert sorted(map(bytes, both)) == sorted(map(bytes, every))
