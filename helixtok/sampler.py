"""ChunkSampler: a global shuffle that is a seeded bijection of (seed, epoch), split across ranks, resumable."""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from .errors import ConfigError
from .stats import samples_per_rank

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)
BLOCK = 1 << 16  # positions computed per step: memory stays flat, nothing is built up front


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

    def __init__(self, n: int, *, seed: int, epoch: int):
        self.n = n
        bits = max(2, math.ceil(math.log2(max(n, 2))))
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.random.default_rng([seed & 0xFFFFFFFF, seed >> 32, epoch]).integers(
            0, 2**63, size=4, dtype=np.int64).astype(np.uint64)

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


class ChunkSampler:
    """Sampler for MemmapChunkDataset (or any sized dataset) for one rank of `world_size`.

    Same epoch layout as torch's DistributedSampler: the epoch's global order is padded by
    wrapping around (drop_last=False) or truncated (drop_last=True) to a multiple of
    world_size, and rank r takes positions r, r + W, r + 2W, ...  So `len(sampler)` equals
    `helixtok stats --world-size W [--drop-last]`'s samples_per_rank, and ranks are disjoint
    and together cover the epoch exactly once (up to the wrap-around padding).

    Resume: `state = sampler.state_dict(samples_consumed)` at a checkpoint (what the training
    loop consumed on this rank this epoch: batches x batch_size); after `load_state_dict(state)`
    the next iteration starts at exactly the next sample, whatever num_workers is.

    Elastic resume: the state also records the global position (samples_consumed x world_size:
    every rank consumed as many).  Loaded by a sampler with another world size, the rest of the
    epoch — global positions from there on — is split over the new ranks, so no sample of the
    epoch is lost or repeated; with a fixed global batch (batch x world size), every later
    global batch holds the same samples as it would have on the old ranks.
    """

    def __init__(self, data_source, *, seed: int = 0, shuffle: bool = True, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False):
        self.n = len(data_source)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        self.seed, self.shuffle, self.rank, self.world_size, self.drop_last = seed, shuffle, rank, world_size, drop_last
        self.epoch = 0
        self.pairs = bool(getattr(data_source, "repack", False))
        self._rebase(0)

    def _rebase(self, base: int) -> None:
        """This epoch's positions start at global position `base` (0, or an elastic resume's)."""
        self._base = base
        self.num_samples = samples_per_rank(self.n - base, self.world_size, self.drop_last) if base < self.n else 0
        self._offset = 0

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
        pos = self._base + (self.rank + self.world_size * k) % (self.n - self._base)
        if not self.shuffle:
            return pos
        return Permutation(self.n, seed=self.seed, epoch=self.epoch)(pos)

    def __iter__(self) -> Iterator[int | tuple[int, int]]:
        for a in range(self._offset, self.num_samples, BLOCK):
            got = self.indices(a, min(a + BLOCK, self.num_samples)).tolist()
            # A dataset that repacks every epoch is told the epoch with each index: DataLoader
            # workers (persistent ones too) then read the epoch's packing without set_epoch.
            yield from ([(self.epoch, i) for i in got] if self.pairs else got)
        # A resumed position applies to one epoch only; len() stays right while the epoch runs.
        self._rebase(0)

    def state_dict(self, samples_consumed: int) -> dict:
        consumed = min(self._base + int(samples_consumed) * self.world_size, self.n)
        return {"seed": self.seed, "epoch": self.epoch, "offset": int(samples_consumed), "n": self.n,
                "world_size": self.world_size, "rank": self.rank, "drop_last": self.drop_last,
                "shuffle": self.shuffle, "base": self._base, "global_consumed": consumed}

    def load_state_dict(self, state: dict) -> None:
        """Continue from state_dict()'s output; a state that is not one (missing or mistyped
        keys, world_size < 1, a position outside the epoch) is refused with one ConfigError."""
        state = _checked_state(state)
        for k in ("seed", "n", "drop_last", "shuffle"):
            if state[k] != getattr(self, k):
                raise ConfigError(f"sampler state has {k}={state[k]!r}, this sampler {getattr(self, k)!r}; "
                                  "resume with the same dataset, seed and drop_last")
        if state["world_size"] == self.world_size:  # the same split of the epoch: continue it exactly
            base = state["base"]
            num = samples_per_rank(self.n - base, self.world_size, self.drop_last) if base < self.n else 0
            if not 0 <= state["offset"] <= num:
                raise ConfigError(f"sampler state offset {state['offset']} outside [0, {num}]: not a position "
                                  "of this epoch; pass the state_dict() this sampler's epoch gave")
            self.epoch = state["epoch"]
            self._rebase(base)
            self._offset = state["offset"]
        else:  # elastic: the rest of the epoch, from its global position, over the new ranks
            self.epoch = state["epoch"]
            self._rebase(state["global_consumed"])


_STATE_TYPES = {"seed": int, "epoch": int, "offset": int, "n": int, "world_size": int, "rank": int,
                "drop_last": bool, "shuffle": bool, "base": int, "global_consumed": int}


def _checked_state(state) -> dict:
    """A sampler state's shape, checked: one ConfigError instead of a KeyError or numpy's ValueError later."""
    if not isinstance(state, dict):
        raise ConfigError(f"sampler state must be the dict state_dict() returns, got {type(state).__name__}")
    state = {"base": 0, **state}  # states saved before `base` existed
    for k, t in _STATE_TYPES.items():
        v = state.get(k)
        if not isinstance(v, t) or (t is int and isinstance(v, bool)):
            raise ConfigError(f"sampler state: {k} must be {'true or false' if t is bool else 'a whole number'}, "
                              f"got {v!r}; pass what state_dict() returned")
    if state["world_size"] < 1 or not 0 <= state["rank"] < state["world_size"]:
        raise ConfigError(f"sampler state: rank {state['rank']} of world_size {state['world_size']} is not a rank")
    for k in ("epoch", "offset", "base", "n"):
        if state[k] < 0:
            raise ConfigError(f"sampler state: {k} is {state[k]}, below 0")
    if not 0 <= state["base"] <= state["n"] or not 0 <= state["global_consumed"] <= state["n"]:
        raise ConfigError(f"sampler state: position past the end of its {state['n']} samples")
    return state
