"""MixtureDataset: several datasets blended by weight into one map-style dataset of exact length."""

from __future__ import annotations

import numpy as np

from . import require_torch

require_torch()
from torch.utils.data import Dataset  # noqa: E402

from .errors import ConfigError


class MixtureDataset(Dataset):
    """Source i contributes exactly counts[i] samples, counts proportional to `weights`
    (largest-remainder rounding, so they sum to `num_samples`).

    The index space is the sources' segments one after another; a sampler with shuffle
    (ChunkSampler, DataLoader(shuffle=True)) blends them. A source asked for more samples
    than it holds is repeated in whole passes; `num_samples` defaults to the largest total
    at which no source repeats.

    Example: MixtureDataset([web, code], weights=[3, 1]) with len(web)=900, len(code)=1000
      -> num_samples 1200, counts [900, 300].
    """

    def __init__(self, datasets, weights, *, num_samples: int | None = None):
        if len(datasets) != len(weights) or not datasets:
            raise ConfigError("give one weight per dataset (and at least one dataset)")
        w = np.asarray(weights, dtype=np.float64)
        if (w < 0).any() or w.sum() <= 0:
            raise ConfigError(f"weights must be >= 0 and not all 0, got {list(weights)}")
        w = w / w.sum()
        lens = np.array([len(d) for d in datasets], dtype=np.int64)
        if num_samples is None:
            pos = w > 0
            num_samples = int(np.floor((lens[pos] / w[pos]).min() + 1e-9))
        raw = w * num_samples
        counts = np.floor(raw).astype(np.int64)
        rest = num_samples - int(counts.sum())
        counts[np.argsort(-(raw - counts), kind="stable")[:rest]] += 1
        if ((counts > 0) & (lens == 0)).any():
            raise ConfigError("a dataset with weight > 0 is empty")
        self.datasets = list(datasets)
        self.counts = counts
        self._starts = np.concatenate(([0], np.cumsum(counts)))

    def __len__(self) -> int:
        return int(self._starts[-1])

    def locate(self, i: int) -> tuple[int, int]:
        if not 0 <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} samples")
        s = int(np.searchsorted(self._starts, i, side="right") - 1)
        return s, int(i - self._starts[s]) % len(self.datasets[s])

    def __getitem__(self, i: int):
        s, j = self.locate(int(i) + (len(self) if i < 0 else 0))
        return self.datasets[s][j]
