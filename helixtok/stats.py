"""Exact step arithmetic from the manifest: what len(DataLoader) and the LR schedule will see."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from .errors import ConfigError
from .manifest import load_manifest, split_entry


def samples_per_rank(num_chunks: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank gets per epoch; the same rule as torch's DistributedSampler."""
    if world_size == 1:
        return num_chunks
    if drop_last and num_chunks % world_size:
        return math.ceil((num_chunks - world_size) / world_size)
    return math.ceil(num_chunks / world_size)


def batches_per_epoch(num_chunks: int, batch_size: int, world_size: int = 1, drop_last: bool = False) -> int:
    n = samples_per_rank(num_chunks, world_size, drop_last)
    return n // batch_size if drop_last else math.ceil(n / batch_size)


@dataclass(frozen=True)
class Stats:
    split: str
    seq_len: int
    chunks: int
    tokens: int
    real_tokens: int
    batch_size: int
    grad_accum: int
    world_size: int
    epochs: int
    drop_last: bool
    samples_per_rank: int
    batches_per_epoch: int
    optimizer_steps_per_epoch: int
    total_optimizer_steps: int
    warmup_ratio: float
    warmup_steps: int
    tokens_per_optimizer_step: int

    def to_json(self) -> dict:
        return asdict(self)


def compute_stats(manifest: dict, *, split: str = "train", batch_size: int = 1, grad_accum: int = 1,
                  world_size: int = 1, epochs: int = 1, drop_last: bool = False, warmup_ratio: float = 0.0,
                  where: str = "dataset") -> Stats:
    for name, v in (("batch-size", batch_size), ("grad-accum", grad_accum), ("world-size", world_size),
                    ("epochs", epochs)):
        if v < 1:
            raise ConfigError(f"--{name} must be >= 1, got {v}")
    if not 0.0 <= warmup_ratio <= 1.0:
        raise ConfigError(f"--warmup-ratio must be in [0, 1], got {warmup_ratio}")
    s = split_entry(manifest, split, where)
    n = s["num_chunks"]
    L = manifest["seq_len"]
    batches = batches_per_epoch(n, batch_size, world_size, drop_last)
    # A partial accumulation window is flushed at epoch end (HelixLM's Trainer does), hence ceil.
    steps = math.ceil(batches / grad_accum)
    total = steps * epochs
    return Stats(
        split=split, seq_len=L, chunks=n, tokens=s["num_tokens"],
        real_tokens=s["num_tokens"] - s["pad_tokens"],
        batch_size=batch_size, grad_accum=grad_accum, world_size=world_size, epochs=epochs,
        drop_last=drop_last, samples_per_rank=samples_per_rank(n, world_size, drop_last),
        batches_per_epoch=batches, optimizer_steps_per_epoch=steps, total_optimizer_steps=total,
        warmup_ratio=warmup_ratio, warmup_steps=math.ceil(warmup_ratio * total),
        tokens_per_optimizer_step=batch_size * grad_accum * world_size * L,
    )


def stats_for(out_dir: str, **kw) -> Stats:
    return compute_stats(load_manifest(out_dir), where=out_dir, **kw)
