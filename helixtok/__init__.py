"""helixtok: pre-tokenize corpora into memory-mappable shards with exact counts.

This module is the public API and nothing else; docs/architecture.md maps the folders below it."""

from .version import __version__

__all__ = ["BuildConfig", "ChunkSampler", "MemmapChunkDataset", "MemmapDocumentDataset", "Mixture", "MixtureDataset",
           "Skip", "Stage", "TokenBudgetSampler", "build",
           "collate_varlen", "repack", "to_hf", "__version__"]


def __getattr__(name):
    # Imported when asked for: the CLI must start fast (no numpy, no torch) and build needs no torch.
    if name == "build":
        from .pipeline.builder import build

        return build
    if name == "Skip":
        from .pipeline.sources import Skip

        return Skip
    if name == "to_hf":
        from .export.hf import to_hf

        return to_hf
    if name == "repack":
        from .repacking import repack

        return repack
    if name == "BuildConfig":
        from .pipeline.config import BuildConfig

        return BuildConfig
    if name == "MemmapChunkDataset":
        from .read.dataset import MemmapChunkDataset

        return MemmapChunkDataset
    if name in ("MemmapDocumentDataset", "TokenBudgetSampler", "collate_varlen"):
        from .read import documents

        return getattr(documents, name)
    if name == "MixtureDataset":
        from .read.mixture import MixtureDataset

        return MixtureDataset
    if name in ("Mixture", "Stage"):
        from .read import schedule

        return getattr(schedule, name)
    if name == "ChunkSampler":
        from .read.sampler import ChunkSampler

        return ChunkSampler
    raise AttributeError(name)
