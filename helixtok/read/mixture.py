"""MixtureDataset: several datasets blended by weight, per batch, each source read through its own permutation."""

from __future__ import annotations

import numpy as np

from . import require_torch

require_torch()
from torch.utils.data import Dataset  # noqa: E402

from ..format.errors import ConfigError  # noqa: E402
from .sampler import Permutation  # noqa: E402


class MixtureDataset(Dataset):
    """Index i of epoch e is already blended and shuffled: read it in order (no shuffling
    sampler; `DistributedSampler(shuffle=False)` or `ChunkSampler(shuffle=False)` across ranks).

    - Per step: every consecutive block of `batch_size` indices (set it to the *global* batch,
      per-rank batch x world size) holds floor or ceil of weight x batch_size samples of each
      source, and at the end of every block each source's running count is within 1 of weight x
      samples (as Megatron's blended dataset balances); a block's samples are shuffled, so a
      count taken mid-block may be off by up to that block's share.
    - Every chunk used: source s is read as a stream through its own seeded permutation that
      continues across epochs (`set_epoch`), so each of its chunks is used once before any
      repeats; a down-weighted source is covered over several epochs, never the same prefix.
    - Exact length: `num_samples` per epoch (default: the largest at which no source repeats
      within one epoch); `counts[s]` samples of source s per epoch.

    Example: MixtureDataset([web, code], weights=[3, 1], batch_size=8) with len(web)=900,
      len(code)=1000 -> len 1200, counts [900, 300]; each block of 8 holds 6 web + 2 code.
    """

    def __init__(self, datasets, weights, *, num_samples: int | None = None, batch_size: int = 1, seed: int = 0):
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError("give one weight per dataset (and at least one dataset)")
        w = np.asarray(weights, dtype=np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise ConfigError(f"weights must be >= 0 and not all 0, got {list(weights)}")
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        w = w / w.sum()
        lens = np.array([len(d) for d in datasets], dtype=np.int64)
        if ((w > 0) & (lens == 0)).any():
            raise ConfigError("a dataset with weight > 0 is empty")
        if num_samples is None:
            pos = w > 0
            num_samples = int(np.floor((lens[pos] / w[pos]).min() + 1e-9))
        self.datasets = list(datasets)
        self.weights = w
        self.lens = lens
        self.batch_size = batch_size
        self.seed = seed
        self.epoch = 0
        self._n = int(num_samples)
        self._bounds = self._plan(w, self._n, batch_size)  # [blocks + 1, sources]: cumulative counts
        self.counts = self._bounds[-1].copy()

    @staticmethod
    def _plan(w: np.ndarray, n: int, B: int) -> np.ndarray:
        """Cumulative samples per source at every block boundary: each block gives a source
        floor(w B) or that + 1, the extras going to the sources furthest behind w x (samples so far)."""
        nblocks = -(-n // B)
        out = np.zeros((nblocks + 1, len(w)), dtype=np.int64)
        have = np.zeros(len(w), dtype=np.int64)
        for k in range(nblocks):
            size = min(B, n - k * B)
            base = np.floor(w * size + 1e-12).astype(np.int64)
            extra = size - int(base.sum())
            deficit = w * (k * B + size) - (have + base)
            deficit[w == 0] = -np.inf
            if extra:
                base[np.argsort(-deficit, kind="stable")[:extra]] += 1
            have += base
            out[k + 1] = have
        return out

    def __len__(self) -> int:
        return self._n

    def set_epoch(self, epoch: int) -> None:
        """Epoch e continues each source's stream where epoch e - 1 stopped."""
        self.epoch = int(epoch)

    def locate(self, i: int) -> tuple[int, int]:
        """(source, index in that source) of sample i in the current epoch."""
        if not 0 <= i < self._n:
            raise IndexError(f"index {i} out of range for {self._n} samples")
        k, off = divmod(i, self.batch_size)
        in_block = self._bounds[k + 1] - self._bounds[k]
        s = int(np.searchsorted(np.cumsum(in_block), off, side="right"))
        pos = int(self._bounds[k][s] + off - (np.cumsum(in_block)[s - 1] if s else 0))
        g = self.epoch * int(self.counts[s]) + pos  # position in source s's endless stream
        n = int(self.lens[s])
        perm = Permutation(n, seed=self.seed * 1_000_003 + s, epoch=g // n)
        return s, int(perm(np.array([g % n]))[0])

    def __getitem__(self, i: int):
        s, j = self.locate(int(i) + (self._n if i < 0 else 0))
        return self.datasets[s][j]

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "seed": self.seed, "num_samples": self._n, "batch_size": self.batch_size,
                "weights": self.weights.tolist(), "lens": self.lens.tolist()}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for k in ("seed", "num_samples", "batch_size", "weights", "lens"):
            if state[k] != mine[k]:
                raise ConfigError(f"mixture state has {k}={state[k]!r}, this mixture {mine[k]!r}; "
                                  "resume with the same sources and options")
        self.epoch = state["epoch"]
