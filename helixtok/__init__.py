"""helixtok: pre-tokenize corpora into memory-mappable shards with exact counts."""

__version__ = "0.1.0"

__all__ = ["ChunkSampler", "MemmapChunkDataset", "MixtureDataset", "__version__"]


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
