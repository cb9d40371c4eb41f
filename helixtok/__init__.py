"""helixtok: pre-tokenize corpora into memory-mappable shards with exact counts."""

__version__ = "0.1.0"

__all__ = ["ChunkSampler", "MemmapChunkDataset", "MixtureDataset", "__version__"]


def require_torch():
    """Import torch, or say which extra brings it: building and stats need no torch."""
    try:
        import torch
    except ImportError:
        raise ImportError("helixtok's torch datasets need PyTorch: pip install 'helixtok[torch]' "
                          "(or install torch yourself first, e.g. a CPU build)") from None
    return torch


def __getattr__(name):
    # torch is imported only when the dataset is asked for: the CLI must start fast without it.
    if name == "MemmapChunkDataset":
        from .dataset import MemmapChunkDataset

        return MemmapChunkDataset
    if name == "MixtureDataset":
        from .mixture import MixtureDataset

        return MixtureDataset
    if name == "ChunkSampler":
        from .sampler import ChunkSampler

        return ChunkSampler
    raise AttributeError(name)
