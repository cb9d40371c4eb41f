"""A split's documents as items (cut at max_len) and the token-budget batches they make: what
MemmapDocumentDataset, TokenBudgetSampler and `helixtok stats --max-tokens` share (no torch)."""

from __future__ import annotations

import numpy as np

from ..format.bestfit import place
from ..format.errors import ConfigError
from ..format.manifest import load_manifest
from ..format.objstore import is_url
from .stats import samples_per_rank


def document_items(doc_pos: np.ndarray, doc_len: np.ndarray, max_len: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(stream position, tokens) of every item: each document whole, or (max_len) cut into pieces
    of max_len at fixed positions from its start, the last the rest."""
    pos, n = np.asarray(doc_pos, np.int64), np.asarray(doc_len, np.int64)
    if max_len is None:
        return pos, n
    if max_len < 1:
        raise ConfigError(f"max_len must be at least 1 token, got {max_len}")
    pieces = -(-n // max_len)
    doc = np.repeat(np.arange(len(n)), pieces)
    k = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    ipos = pos[doc] + k * max_len
    return ipos, np.minimum(max_len, n[doc] - k * max_len)


def budget_batches(sizes: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Items into batches of at most max_tokens tokens by best-fit decreasing (format/bestfit.place:
    a function of the sizes alone): (items, first), batch b holding items[first[b]:first[b+1]] in
    ascending order.  An item longer than max_tokens is refused."""
    sizes = np.asarray(sizes, np.int64)
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be at least 1, got {max_tokens}")
    if len(sizes) and int(sizes.max()) > max_tokens:
        raise ConfigError(f"a document of {int(sizes.max()):,} tokens does not fit max_tokens {max_tokens:,}: raise "
                          f"max_tokens, or cut documents with max_len (at most {max_tokens:,})")
    bins = place(sizes, max_tokens) if len(sizes) else np.empty(0, np.int64)
    items = np.lexsort((np.arange(len(bins)), bins))
    first = np.concatenate(([0], np.cumsum(np.bincount(bins, minlength=int(bins.max()) + 1 if len(bins) else 0))))
    return items, first.astype(np.int64)


def budget_stats(sizes: np.ndarray, max_tokens: int, world_size: int = 1, drop_last: bool = False) -> dict:
    """What an epoch of TokenBudgetSampler gives: batches in all and per rank (DistributedSampler's
    rule over batches), the tokens, and the padding a batch padded to max_tokens adds."""
    _, first = budget_batches(sizes, max_tokens)
    nb = len(first) - 1
    tokens = int(np.asarray(sizes, np.int64).sum())
    return {"max_tokens": max_tokens, "items": len(sizes), "tokens": tokens, "batches_per_epoch": nb,
            "batches_per_rank": samples_per_rank(nb, world_size, drop_last), "world_size": world_size,
            "pad_tokens_if_padded": nb * max_tokens - tokens,
            "fill": round(tokens / (nb * max_tokens), 4) if nb else 0.0}


def budget_for(out_dir: str, split: str, max_tokens: int, max_len: int | None, world_size: int = 1,
               drop_last: bool = False) -> dict:
    """`helixtok stats --max-tokens`: the token-budget batches of OUT's document view (MemmapDocumentDataset
    with max_len, TokenBudgetSampler with max_tokens), exact from the .docs sidecars."""
    from .splitview import SplitView

    if is_url(out_dir):
        raise ConfigError(f"{out_dir}: --max-tokens reads the documents' lengths from a local dataset; helixtok "
                          "pull it first")
    m = load_manifest(out_dir)
    if m["packing"] == "document":
        raise ConfigError(f"{out_dir}: packed with --pack document, which keeps no document boundaries past whole "
                          "chunks; --max-tokens counts a packed or bestfit build's documents")
    v = SplitView(out_dir, m, split)
    end = int(v.starts[-1])
    pos = v.starts_in(0, end)
    _, sizes = document_items(pos, np.diff(np.append(pos, end)), max_len)
    return {"split": split, "max_len": max_len, **budget_stats(sizes, max_tokens, world_size, drop_last)}
