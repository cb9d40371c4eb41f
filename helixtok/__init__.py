"""helixtok: pre-tokenize corpora into memory-mappable shards with exact counts."""

__version__ = "0.3.0"

__all__ = ["BuildConfig", "ChunkSampler", "MemmapChunkDataset", "Mixture", "MixtureDataset", "Stage", "build",
           "__version__"]


def require_torch():
    """Import torch, or say which extra brings it: building and stats need no torch."""
    try:
        import torch
    except ImportError:
        raise ImportError("helixtok's torch datasets need PyTorch: pip install 'helixtok[torch]' "
                          "(or install torch yourself first, e.g. a CPU build)") from None
    return torch


def __getattr__(name):
    # Imported when asked for: the CLI must start fast (no numpy, no torch) and build needs no torch.
    if name == "build":
        from .builder import build

        return build
    if name == "BuildConfig":
        from .config import BuildConfig

        return BuildConfig
    if name == "MemmapChunkDataset":
        from .dataset import MemmapChunkDataset

        return MemmapChunkDataset
    if name == "MixtureDataset":
        from .mixture import MixtureDataset

        return MixtureDataset
    if name in ("Mixture", "Stage"):
        from . import schedule

        return getattr(schedule, name)
    if name == "ChunkSampler":
        from .sampler import ChunkSampler

        return ChunkSampler
    raise AttributeError(name)
