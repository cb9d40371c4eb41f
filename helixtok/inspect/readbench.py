"""Loader throughput of a built dataset, and whether it keeps up with a model's tokens/s."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from ..read import require_torch


@dataclass
class ReadRate:
    tokens_per_s: float
    batches: int
    seconds: float
    batch_size: int
    seq_len: int
    num_workers: int
    need_tokens_per_s: float | None = None

    @property
    def headroom(self) -> float | None:
        """How many times what the model consumes the loader delivers (None if no need was given)."""
        return self.tokens_per_s / self.need_tokens_per_s if self.need_tokens_per_s else None

    def to_json(self) -> dict:
        return {**asdict(self), "headroom": self.headroom}


def loader_rate(ds, batch_size: int, num_workers: int = 0, seconds: float = 3.0, collate_fn=None) -> tuple[float, int]:
    """(tokens/s, batches) of a shuffled DataLoader over ds, after the first batch (start-up is
    not throughput), cycling epochs until `seconds` have passed."""
    require_torch()
    from torch.utils.data import DataLoader

    dl = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=num_workers,
                    persistent_workers=num_workers > 0, collate_fn=collate_fn)
    it = iter(dl)
    next(it)
    n = batches = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        try:
            b = next(it)
        except StopIteration:
            it = iter(dl)
            continue
        n += b["input_ids"].numel()
        batches += 1
    return n / (time.perf_counter() - t0), batches


def measure(path: str, *, split: str = "train", batch_size: int = 8, num_workers: int = 0, seconds: float = 3.0,
            need_tokens_per_s: float | None = None, document_masking: bool = False) -> ReadRate:
    """Tokens/s that MemmapChunkDataset + DataLoader(collate_fn=ds.collate) deliver from `path`."""
    from ..read.dataset import MemmapChunkDataset

    ds = MemmapChunkDataset(path, split, document_masking=document_masking)
    t0 = time.perf_counter()
    rate, batches = loader_rate(ds, batch_size, num_workers, seconds, ds.collate)
    return ReadRate(rate, batches, time.perf_counter() - t0, batch_size, ds.seq_len, num_workers, need_tokens_per_s)
