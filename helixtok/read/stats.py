"""Exact step arithmetic from the manifest: what len(DataLoader) and the LR schedule will see."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from ..format.errors import ConfigError
from ..format.manifest import load_manifest, read_seq_len, shard_tokens, split_entry
from ..format.objstore import is_url


def samples_per_rank(num_chunks: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank gets per epoch; the same rule as torch's DistributedSampler."""
    if world_size == 1:
        return num_chunks
    if drop_last and num_chunks % world_size:
        return math.ceil((num_chunks - world_size) / world_size)
    return math.ceil(num_chunks / world_size)


def batches_per_epoch(num_chunks: int, batch_size: int, world_size: int = 1, drop_last: bool = False, *,
                      sampler_drop_last: bool | None = None, loader_drop_last: bool | None = None) -> int:
    """len(DataLoader): DistributedSampler(drop_last=sampler_drop_last) feeding
    DataLoader(drop_last=loader_drop_last) -- two independent torch settings; `drop_last` sets both."""
    sd = drop_last if sampler_drop_last is None else sampler_drop_last
    ld = drop_last if loader_drop_last is None else loader_drop_last
    n = samples_per_rank(num_chunks, world_size, sd)
    return n // batch_size if ld else math.ceil(n / batch_size)


@dataclass(frozen=True)
class Stats:
    split: str
    seq_len: int
    chunks: int
    stored_tokens: int  # chunks x seq_len, padding included
    real_tokens: int  # stored_tokens - padding
    batch_size: int
    grad_accum: int
    world_size: int
    epochs: int
    sampler_drop_last: bool  # DistributedSampler(drop_last=...)
    loader_drop_last: bool  # DataLoader(drop_last=...)
    samples_per_rank: int
    batches_per_epoch: int
    optimizer_steps_per_epoch: int
    total_optimizer_steps: int
    warmup_ratio: float
    warmup_steps: int
    tokens_per_optimizer_step: int
    # A chat build's: the split's tokens with a label (--loss decides), what one epoch trains on
    # (all of it unless a drop_last leaves chunks out), and its mean per optimizer step.
    trainable_tokens_per_epoch: int | None = None
    mean_trainable_tokens_per_step: float | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None or "trainable" not in k}


def compute_stats(manifest: dict, *, split: str = "train", batch_size: int = 1, grad_accum: int = 1,
                  world_size: int = 1, epochs: int = 1, drop_last: bool = False, warmup_ratio: float = 0.0,
                  sampler_drop_last: bool | None = None, loader_drop_last: bool | None = None,
                  where: str = "dataset", seq_len: int | None = None, tail_ones=None) -> Stats:
    """Exact counts for DistributedSampler(drop_last=sampler_drop_last) + DataLoader(drop_last=
    loader_drop_last); `drop_last` sets both.  A run with zero optimizer steps is a ConfigError.
    seq_len: read packed data at another length (MemmapChunkDataset(seq_len=)); a chat build's
    trainable tokens then need tail_ones(split entry, n): the masks' 1s in the stream's last n tokens
    (stats_for reads them), else they are not given."""
    sd = drop_last if sampler_drop_last is None else sampler_drop_last
    ld = drop_last if loader_drop_last is None else loader_drop_last
    for name, v in (("batch-size", batch_size), ("grad-accum", grad_accum), ("world-size", world_size),
                    ("epochs", epochs)):
        if v < 1:
            raise ConfigError(f"--{name} must be >= 1, got {v}")
    if not 0.0 <= warmup_ratio <= 1.0:
        raise ConfigError(f"--warmup-ratio must be in [0, 1], got {warmup_ratio}")
    s = split_entry(manifest, split, where)
    L, n = read_seq_len(manifest, s, seq_len, where)
    stored = real = n * L
    if L == manifest["seq_len"]:
        stored, real = s["num_tokens"], s["num_tokens"] - s["pad_tokens"]
    batches = batches_per_epoch(n, batch_size, world_size, sampler_drop_last=sd, loader_drop_last=ld)
    # A partial accumulation window is flushed at epoch end (HelixLM's Trainer does), hence ceil.
    steps = math.ceil(batches / grad_accum)
    total = steps * epochs
    if total == 0:
        per_rank = samples_per_rank(n, world_size, sd)
        raise ConfigError(f"{where}: split {split!r} has {n} samples, {per_rank} per rank with world size "
                          f"{world_size}: not one full batch of {batch_size}, so 0 optimizer steps; lower "
                          "--batch-size or --world-size, drop --loader-drop-last, or build more data")
    # What an epoch's labels train on: the masks' 1s less those in no chunk (packed: the last
    # partial chunk; a manifest written before that was counted lacks the key).
    trainable = s["chat"]["trainable_tokens"] - s["chat"].get("dropped_trainable_tokens", 0) if "chat" in s else None
    if trainable is not None and L != manifest["seq_len"]:
        stream = sum(shard_tokens(e, manifest["seq_len"]) for e in s["shards"])
        trainable = s["chat"]["trainable_tokens"] - tail_ones(s, stream - n * L) if tail_ones else None
    return Stats(
        split=split, seq_len=L, chunks=n, stored_tokens=stored, real_tokens=real,
        batch_size=batch_size, grad_accum=grad_accum, world_size=world_size, epochs=epochs,
        sampler_drop_last=sd, loader_drop_last=ld, samples_per_rank=samples_per_rank(n, world_size, sd),
        batches_per_epoch=batches, optimizer_steps_per_epoch=steps, total_optimizer_steps=total,
        warmup_ratio=warmup_ratio, warmup_steps=math.ceil(warmup_ratio * total),
        tokens_per_optimizer_step=batch_size * grad_accum * world_size * L,
        trainable_tokens_per_epoch=trainable,
        mean_trainable_tokens_per_step=round(trainable / steps, 1) if trainable is not None else None,
    )


def stats_for(out_dir: str, **kw) -> Stats:
    def tail_ones(s: dict, n: int) -> int:  # a local chat build's masks, read from their end (< seq_len bytes)
        ones = 0
        for e in reversed(s["shards"]):
            if n <= 0:
                break
            k = min(n, int(e["num_tokens"]))
            with open(os.path.join(out_dir, e["mask"]["path"]), "rb") as fh:
                fh.seek(int(e["num_tokens"]) - k)
                ones += fh.read(k).count(1)
            n -= k
        return ones
    return compute_stats(load_manifest(out_dir), where=out_dir, tail_ones=None if is_url(out_dir) else tail_ones, **kw)

