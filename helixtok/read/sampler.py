"""ChunkSampler: a global shuffle that is a seeded bijection of (seed, epoch), split across ranks, resumable."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from ..format.errors import ConfigError
from .stats import samples_per_rank

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
BLOCK = 1 << 16  # positions computed per step: memory stays flat, nothing is built up front
# A dataset in object storage is asked for the blocks of the next PREFETCH_AHEAD samples every
# PREFETCH_STEP samples (each block once: its cache knows what it holds or is fetching).
PREFETCH_STEP, PREFETCH_AHEAD = 256, 1024


def _mix(x: np.ndarray) -> np.ndarray:
    # splitmix64 finalizer: a good 64-bit mixer; uint64 arithmetic wraps as intended.
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A bijection of [0, n) keyed by (seed, epoch): a 4-round Feistel network on the smallest
    even-bit power-of-two domain >= n, with cycle walking back into [0, n).

    Example: sorted(Permutation(10, seed=1, epoch=0)(np.arange(10))) == list(range(10))
    """

    def __init__(self, n: int, *, seed: int, epoch: int, stream: int | None = None):
        self.n = n
        bits = max(2, math.ceil(math.log2(max(n, 2))))
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        # stream: another independent permutation of the same (seed, epoch) (block shuffle's windows)
        key = [seed & 0xFFFFFFFF, seed >> 32, epoch] + ([] if stream is None else [1 + stream])
        self.keys = np.random.default_rng(key).integers(0, 2**63, size=4, dtype=np.int64).astype(np.uint64)

    def _round(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k) & self.mask)
        return (left << self.half) | right

    def __call__(self, pos: np.ndarray) -> np.ndarray:
        with np.errstate(over="ignore"):
            x = self._round(pos.astype(np.uint64))
            out = x >= np.uint64(self.n)
            while out.any():  # cycle walking: expected < 4 extra rounds, since domain < 4n
                x[out] = self._round(x[out])
                out = x >= np.uint64(self.n)
        return x.astype(np.int64)


class BlockOrder:
    """An epoch's order under block shuffle: the blocks in a seeded order, and the chunks of each
    window of `window` consecutive blocks of that order shuffled among themselves.  A bijection of
    the chunk ids keyed by (seed, epoch), computed per position like Permutation (nothing of the
    epoch's size is built): a rank reading its positions in order reads one window at a time.

    bounds, order: dataset.block_of_chunks() (block b holds chunks order[bounds[b]:bounds[b+1]]).
    """

    def __init__(self, bounds: np.ndarray, order: np.ndarray | None, window: int, *, seed: int, epoch: int):
        self.bounds, self.order, self.window, self.seed, self.epoch = bounds, order, window, seed, epoch
        nb = len(bounds) - 1
        self.perm = Permutation(nb, seed=seed, epoch=epoch)(np.arange(nb, dtype=np.int64)) if nb else \
            np.empty(0, np.int64)
        self.cum = np.concatenate(([0], np.cumsum(np.diff(bounds)[self.perm]))).astype(np.int64)
        # Where each window starts in the epoch (and its end); an empty window has no positions.
        self.win = np.unique(np.append(self.cum[::window], self.cum[-1]))

    def __call__(self, pos: np.ndarray) -> np.ndarray:
        pos = np.asarray(pos, dtype=np.int64)
        out = np.empty_like(pos)
        w = np.searchsorted(self.win, pos, side="right") - 1
        for wv in np.unique(w).tolist():
            sel = w == wv
            a, b = int(self.win[wv]), int(self.win[wv + 1])
            at = a + Permutation(b - a, seed=self.seed, epoch=self.epoch, stream=wv)(pos[sel] - a)
            j = np.searchsorted(self.cum, at, side="right") - 1  # the block (in the epoch's order) it falls in
            out[sel] = self.bounds[self.perm[j]] + (at - self.cum[j])
        return out if self.order is None else self.order[out]


class ChunkSampler:
    """Sampler for MemmapChunkDataset (or any sized dataset) for one rank of `world_size`.

    Same epoch layout as torch's DistributedSampler: the epoch's global order is padded by
    wrapping around (drop_last=False) or truncated (drop_last=True) to a multiple of
    world_size, and rank r takes positions r, r + W, r + 2W, ...  So `len(sampler)` equals
    `helixtok stats --world-size W [--drop-last]`'s samples_per_rank, and ranks are disjoint
    and together cover the epoch exactly once (up to the wrap-around padding).

    Resume: `state = sampler.state_dict(samples_consumed)` at a checkpoint (what the training
    loop consumed on this rank this epoch: batches x batch_size); after `load_state_dict(state)`
    the next iteration starts at exactly the next sample, whatever num_workers is.  torchdata's
    `StatefulDataLoader` does it by itself: `loader.state_dict()` holds this sampler's state for
    the last batch it yielded, and `load_state_dict` resumes there (num_workers any).

    Elastic resume: the state also records the global position (samples_consumed x world_size:
    every rank consumed as many).  Loaded by a sampler with another world size, the rest of the
    epoch — global positions from there on — is split over the new ranks, so no sample of the
    epoch is lost or repeated; with a fixed global batch (batch x world size), every later
    global batch holds the same samples as it would have on the old ranks.

    shuffle="block" (a dataset in object storage): the epoch's order is BlockOrder's — blocks of
    the dataset's `block_bytes` in a seeded order, chunks shuffled within each `window` of them —
    and each node (`ranks_per_node` consecutive ranks) takes a contiguous share of it, its ranks
    taking turns within it: a node reads each block of its share once an epoch with a cache of a
    few windows (docs/scale.md), and no block but those at the shares' edges is read by two nodes.
    A dataset that fetches (MemmapChunkDataset over a URL) is told what comes next as this yields.
    An elastic resume goes on with the old layout's remaining positions, split over the new ranks.
    """

    def __init__(self, data_source, *, seed: int = 0, shuffle: bool | str = True, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False, window: int = 8, ranks_per_node: int | None = None):
        self.n = len(data_source)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if shuffle not in (True, False, "block"):
            raise ConfigError(f"shuffle must be True, False or 'block', got {shuffle!r}")
        self.seed, self.shuffle, self.rank, self.world_size, self.drop_last = seed, shuffle, rank, world_size, drop_last
        self.window = window if shuffle == "block" else None
        self._blocks, self._orders = None, {}
        if shuffle == "block":
            if not hasattr(data_source, "block_of_chunks"):
                raise ConfigError("shuffle='block' needs a MemmapChunkDataset (it knows its blocks)")
            if window < 1:
                raise ConfigError(f"window must be >= 1 block, got {window}")
            self._blocks = data_source.block_of_chunks()
        rpn = world_size if ranks_per_node is None else ranks_per_node
        if rpn < 1 or world_size % rpn:
            raise ConfigError(f"ranks_per_node must divide world_size {world_size}, got {ranks_per_node}")
        # Which layout the epoch's positions follow (block shuffle): (world size, ranks per node);
        # an elastic resume keeps the one its state names.
        self._layout = (world_size, rpn) if shuffle == "block" else None
        self._fetcher = data_source if getattr(data_source, "remote", False) else None
        self.epoch = 0
        self.pairs = bool(getattr(data_source, "repack", False))
        self._rebase(0)

    def _positions(self) -> int:
        """How many global positions the epoch has: n, or (block shuffle) the layout's ranks x
        samples each, padding included (a node's share ends in it)."""
        if self._layout is None:
            return self.n
        w = self._layout[0]
        return w * samples_per_rank(self.n, w, self.drop_last)

    def _rebase(self, base: int) -> None:
        """This epoch's positions start at global position `base` (0, or an elastic resume's)."""
        self._base = base
        total = self._positions()
        self.num_samples = samples_per_rank(total - base, self.world_size, self.drop_last) if base < total else 0
        self._offset = 0
        self._pulled: int | None = None  # indices handed out by the running iteration (state_dict())

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self._rebase(0)
        self.epoch = epoch

    def __len__(self) -> int:
        return self.num_samples - self._offset

    def indices(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """This rank's sample indices for positions [start, stop) of the current epoch."""
        stop = self.num_samples if stop is None else stop
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        k = np.arange(start, stop, dtype=np.int64)
        # Wrap-around padding as DistributedSampler, within what is left of the epoch.
        pos = self._base + (self.rank + self.world_size * k) % (self._positions() - self._base)
        if not self.shuffle:
            return pos
        if self.shuffle == "block":
            if self.epoch not in self._orders:
                self._orders = {self.epoch: BlockOrder(*self._blocks, self.window, seed=self.seed, epoch=self.epoch)}
            return self._orders[self.epoch](self._node_share(pos) % self.n)
        return Permutation(self.n, seed=self.seed, epoch=self.epoch)(pos)

    def __iter__(self) -> Iterator[int | tuple[int, int]]:
        self._pulled = self._offset
        for a in range(self._offset, self.num_samples, BLOCK):
            got = self.indices(a, min(a + BLOCK, self.num_samples))
            parts = self._prefetching(got) if self._fetcher is not None else (got.tolist(),)
            for part in parts:
                # A dataset that repacks every epoch is told the epoch with each index: DataLoader
                # workers (persistent ones too) then read the epoch's packing without set_epoch.
                for i in part:
                    self._pulled += 1  # before the yield: what state_dict() says once it is taken
                    yield (self.epoch, i) if self.pairs else i
        # A resumed position applies to one epoch only; len() stays right while the epoch runs.
        self._rebase(0)
        self._pulled = self.num_samples  # the epoch is done: a state taken now resumes after it

    def _node_share(self, pos: np.ndarray) -> np.ndarray:
        """Global position -> place in the block order: rank r's k-th sample is the (r % R + R k)-th
        of its node's share, node r // R's contiguous S x R places (R ranks a node, S samples a
        rank; one node: the position itself)."""
        w, rpn = self._layout
        per_rank = samples_per_rank(self.n, w, self.drop_last)
        r, k = pos % w, pos // w
        return (r // rpn) * (rpn * per_rank) + r % rpn + rpn * k

    def _prefetching(self, got: np.ndarray):
        """got's indices in stretches, the blocks of the next PREFETCH_AHEAD asked for as each starts."""
        for j in range(0, len(got), PREFETCH_STEP):
            self._fetcher.prefetch(got[j: j + PREFETCH_AHEAD])
            yield got[j: j + PREFETCH_STEP].tolist()

    def state_dict(self, samples_consumed: int | None = None) -> dict:
        """Where this rank is in the epoch.  samples_consumed: what the training loop consumed on
        this rank this epoch; None: the indices this sampler has handed out (what torchdata's
        StatefulDataLoader needs: it calls state_dict() as each batch's indices are drawn, and
        keeps the state that matches the batch it yields)."""
        if samples_consumed is None:
            samples_consumed = self._offset if self._pulled is None else self._pulled
        consumed = min(self._base + int(samples_consumed) * self.world_size, self._positions())
        return {"seed": self.seed, "epoch": self.epoch, "offset": int(samples_consumed), "n": self.n,
                "world_size": self.world_size, "rank": self.rank, "drop_last": self.drop_last,
                "shuffle": self.shuffle, "base": self._base, "global_consumed": consumed,
                **({"window": self.window, "layout": list(self._layout)} if self.shuffle == "block" else {})}

    def load_state_dict(self, state: dict) -> None:
        """Continue from state_dict()'s output; a state that is not one (missing or mistyped
        keys, world_size < 1, a position outside the epoch) is refused with one ConfigError."""
        state = _checked_state(state)
        for k in ("seed", "n", "drop_last", "shuffle", "window"):
            if state.get(k) != getattr(self, k):
                raise ConfigError(f"sampler state has {k}={state[k]!r}, this sampler {getattr(self, k)!r}; "
                                  "resume with the same dataset, seed and drop_last")
        if state["world_size"] == self.world_size and (self.shuffle != "block" or
                                                       tuple(state["layout"]) == self._layout):
            # the same split of the epoch: continue it exactly
            base = state["base"]
            if self.shuffle == "block":
                self._layout = tuple(state["layout"])
            total = self._positions()
            num = samples_per_rank(total - base, self.world_size, self.drop_last) if base < total else 0
            if not 0 <= state["offset"] <= num:
                raise ConfigError(f"sampler state offset {state['offset']} outside [0, {num}]: not a position "
                                  "of this epoch; pass the state_dict() this sampler's epoch gave")
            self.epoch = state["epoch"]
            self._rebase(base)
            self._offset = state["offset"]
        else:  # elastic: the rest of the epoch, from its global position, over the new ranks
            self.epoch = state["epoch"]
            if self.shuffle == "block":  # the positions are the old layout's
                self._layout = tuple(state["layout"])
            self._rebase(state["global_consumed"])


_STATE_TYPES = {"seed": int, "epoch": int, "offset": int, "n": int, "world_size": int, "rank": int,
                "drop_last": bool, "shuffle": (bool, str), "base": int, "global_consumed": int}


def _checked_state(state) -> dict:
    """A sampler state's shape, checked: one ConfigError instead of a KeyError or numpy's ValueError later."""
    if not isinstance(state, dict):
        raise ConfigError(f"sampler state must be the dict state_dict() returns, got {type(state).__name__}")
    state = {"base": 0, **state}  # states saved before `base` existed
    for k, t in _STATE_TYPES.items():
        v = state.get(k)
        if not isinstance(v, t) or (t is int and isinstance(v, bool)) or (k == "shuffle" and v not in (True, False,
                                                                                                       "block")):
            want = {bool: "true or false", int: "a whole number"}.get(t, "true, false or 'block'")
            raise ConfigError(f"sampler state: {k} must be {want}, got {v!r}; pass what state_dict() returned")
    if state["world_size"] < 1 or not 0 <= state["rank"] < state["world_size"]:
        raise ConfigError(f"sampler state: rank {state['rank']} of world_size {state['world_size']} is not a rank")
    for k in ("epoch", "offset", "base", "n"):
        if state[k] < 0:
            raise ConfigError(f"sampler state: {k} is {state[k]}, below 0")
    end = state["n"]
    if state["shuffle"] == "block":  # its positions are its layout's, padding included
        lay = state.get("layout")
        if not (isinstance(lay, list) and len(lay) == 2 and all(type(x) is int and x > 0 for x in lay)
                and lay[0] % lay[1] == 0 and isinstance(state.get("window"), int)):
            raise ConfigError("sampler state: a block shuffle's state needs its layout [world_size, ranks_per_node] "
                              "and window; pass what state_dict() returned")
        end = lay[0] * samples_per_rank(state["n"], lay[0], state["drop_last"])
    if not 0 <= state["base"] <= end or not 0 <= state["global_consumed"] <= end:
        raise ConfigError(f"sampler state: position past the end of its {state['n']} samples")
    return state
