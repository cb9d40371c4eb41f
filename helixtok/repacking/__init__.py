"""`helixtok repack` (helixtok.repack): a dataset at another sequence length or packing made from a finished build, nothing tokenized."""

from .run import repack

__all__ = ["repack"]
