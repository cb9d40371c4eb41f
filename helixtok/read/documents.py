"""The document view: one item per document of a packed or bestfit build (or per piece of at most
max_len), for runtime packers, and the token-budget batches a varlen attention step takes."""

from __future__ import annotations

import numpy as np

from . import require_torch

require_torch()
import torch  # noqa: E402

from ..format.errors import ConfigError, DatasetError  # noqa: E402
from .budget import budget_batches, document_items  # noqa: E402
from .dataset import IGNORE_INDEX, MemmapChunkDataset  # noqa: E402
from .sampler import ChunkSampler  # noqa: E402


class MemmapDocumentDataset(MemmapChunkDataset):
    """Documents of a helixtok build, one item each: `ds[i]` is {"input_ids", "labels"}, LongTensors
    of the document's length (its EOS included; labels = input_ids, or -100 where a chat build's
    mask says a token does not train).  max_len: documents longer than it are cut into pieces of
    max_len at fixed positions from their start, one item each (as bestfit cuts them at seq_len).

    len() is exact from the .docs sidecars (8 bytes a document, read when created).  Packed and
    bestfit builds (a document-packed build keeps no document boundaries past whole chunks), local
    or in object storage (path a URL, with cache_dir: read through the node-local block cache as
    MemmapChunkDataset reads it).  Batch them with TokenBudgetSampler and collate_varlen."""

    def __init__(self, path: str, split: str = "train", *, max_len: int | None = None, sources: bool = False, **kw):
        for k in ("shifted", "position_ids", "document_masking", "repack", "seq_len", "fields"):
            if k in kw:
                raise ConfigError(f"MemmapDocumentDataset takes no {k}=: items are whole documents (see max_len)")
        super().__init__(path, split, **kw)
        # Items say where their document was read ("source": file:line, ...) and, where the build kept
        # them, its record's fields ("fields": {"id": ...}).
        self.sources = sources
        if self.packing == "document":
            raise DatasetError(f"{self.path}: packed with --pack document, whose chunks keep no boundary between a "
                               "document that fills whole chunks and the next; build (or helixtok repack) it packed "
                               "or bestfit for a document view")
        self.max_len = max_len
        self._n = len(self._item_spans()[0])

    def _sides(self) -> tuple[str, ...]:
        return ("docs",) + (("src",) if "src" in self._all_sides else ()) + (("mask",) if self.chat else ())

    def _item_spans(self) -> tuple[np.ndarray, np.ndarray]:
        """(stream position, tokens) of every item, from the .docs sidecars (once per process)."""
        if self.__dict__.get("_spans") is None:
            maps = self._maps or self._open()
            starts = [side["docs"] + self._starts[k] for k, (_, side) in enumerate(maps)]
            pos = np.concatenate(starts) if starts else np.empty(0, np.int64)
            end = int(self._starts[-1])
            self._spans = document_items(pos, np.diff(np.append(pos, end)), self.max_len)
            self._docs_of = np.searchsorted(pos, self._spans[0], side="right") - 1  # each item's document
        return self._spans

    def source(self, i: int) -> str | None:
        """Where item i's document was read: `file:line`, `file row N`, `file element N` or the text
        file (docs/format.md); None for a dataset written before builds recorded it."""
        d, k = self._place(i)
        return None if k is None else self._where(d, k)

    def kept_fields(self, i: int) -> dict | None:
        """The fields of item i's record that the build kept (--keep-fields; by default its "id"),
        or None: none kept, the record had none, or a dataset written before builds kept them."""
        from ..format.fields import DocumentFields
        from ..format.objstore import Folder

        d, k = self._place(i)
        if self.__dict__.get("_kept") is None:
            self._kept = DocumentFields(self.manifest, Folder(self.path, self.stall_timeout).read_range)
        return None if k is None else self._kept(self._where.unit_of(d), k)

    def _place(self, i: int) -> tuple[int, int | None]:
        """(item i's document, its .src entry: its place in its work unit, None without .src sidecars),
        the sidecars read once per process, with the split's DocumentSources."""
        from ..format.manifest import DocumentSources

        self._item_spans()
        if self.__dict__.get("_where") is None:
            maps = self._maps or self._open()
            src = [side["src"] for _, side in maps if "src" in side]
            self._src = np.concatenate(src) if src and len(src) == len(maps) else None
            self._where = DocumentSources(self.manifest, self.split)
        d = int(self._docs_of[int(i)])
        return d, None if self._src is None else int(self._src[d])

    def __getstate__(self):
        d = super().__getstate__()
        for k in ("_spans", "_docs_of", "_src", "_where", "_kept"):  # each DataLoader worker reads the sidecars itself
            d.pop(k, None)
        return d

    def __len__(self) -> int:
        return self._n

    def item_sizes(self) -> np.ndarray:
        """Tokens of every item, in order: what TokenBudgetSampler batches."""
        return self._item_spans()[1]

    def __getitem__(self, i) -> dict:
        i = int(i)
        if not 0 <= i < self._n:
            raise IndexError(f"document {i} outside [0, {self._n})")
        pos, size = self._item_spans()
        g, n = int(pos[i]), int(size[i])
        ids = np.empty(n, np.int64)
        self._copy(g, n, ids)
        labels = ids.copy()
        if self.chat:
            m = np.empty(n, np.uint8)
            self._copy(g, n, m, self._arrays("mask"))
            labels[m == 0] = IGNORE_INDEX
        item = {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
        if self.sources:
            item["source"] = self.source(i)
            if self.manifest.get("fields"):
                item["fields"] = self.kept_fields(i) or {}
        return item

    def __getitems__(self, indices) -> list[dict]:
        return [self[i] for i in indices]

    @staticmethod
    def collate(items: list[dict], pad_to: int | None = None, pad_id: int = 0) -> dict:
        return collate_varlen(items, pad_to, pad_id)

    def __repr__(self) -> str:
        return (f"MemmapDocumentDataset({self.path!r}, split={self.split!r}, items={self._n}, "
                f"max_len={self.max_len}, dtype={self.dtype.name}, packing={self.packing})")


def collate_varlen(items: list[dict], pad_to: int | None = None, pad_id: int = 0) -> dict:
    """Items back to back in one row, as flash-attention's varlen kernels take them: input_ids and
    labels [1, T], position_ids restarting at each item, cu_seqlens (int32, item boundaries, T
    last) and max_seqlen.  pad_to: T made exactly that (pad_id, labels -100, one more segment in
    cu_seqlens), so every step has one shape."""
    lens = [len(x["input_ids"]) for x in items]
    total = sum(lens)
    if pad_to is not None and total > pad_to:
        raise ConfigError(f"the batch holds {total} tokens, more than pad_to={pad_to}")
    extra = (pad_to - total) if pad_to is not None else 0
    segs = lens + ([extra] if extra else [])
    ids = torch.cat([x["input_ids"] for x in items] + ([torch.full((extra,), pad_id)] if extra else []))
    labels = torch.cat([x["labels"] for x in items] + ([torch.full((extra,), IGNORE_INDEX)] if extra else []))
    pos = torch.cat([torch.arange(n) for n in segs]) if segs else torch.empty(0, dtype=torch.long)
    cu = torch.tensor(np.concatenate(([0], np.cumsum(segs))), dtype=torch.int32)
    return {"input_ids": ids[None], "labels": labels[None], "position_ids": pos[None], "cu_seqlens": cu,
            "max_seqlen": max(segs) if segs else 0}


class TokenBudgetSampler:
    """Batches of a MemmapDocumentDataset's items holding at most max_tokens tokens each (a batch
    sampler: DataLoader(ds, batch_sampler=s, collate_fn=ds.collate)).

    The batches are placed once, by best-fit decreasing over the item lengths (a function of them
    alone: `helixtok stats --max-tokens N` counts them exactly); each epoch visits them in its own
    seeded order, shared over `world_size` ranks as ChunkSampler shares chunks (DistributedSampler's
    rule: len() = batches on this rank).  Resume exactly, and elastically, as ChunkSampler does:
    state_dict(batches_consumed) / load_state_dict (torchdata's StatefulDataLoader calls them)."""

    def __init__(self, dataset: MemmapDocumentDataset, max_tokens: int, *, seed: int = 0, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1, drop_last: bool = False):
        self.max_tokens = int(max_tokens)
        self._items, self._first = budget_batches(dataset.item_sizes(), self.max_tokens)
        self.num_batches = len(self._first) - 1
        self._order = ChunkSampler(range(self.num_batches), seed=seed, shuffle=shuffle, rank=rank,
                                   world_size=world_size, drop_last=drop_last)

    def set_epoch(self, epoch: int) -> None:
        self._order.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self):
        for b in self._order:
            yield self._items[self._first[b]: self._first[b + 1]].tolist()

    def state_dict(self, batches_consumed: int | None = None) -> dict:
        return {"max_tokens": self.max_tokens, "batches": self.num_batches, **self._order.state_dict(batches_consumed)}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        got = (state.pop("max_tokens", None), state.pop("batches", None))
        if got != (self.max_tokens, self.num_batches):
            raise ConfigError(f"sampler state is of max_tokens {got[0]} ({got[1]} batches), this sampler "
                              f"max_tokens {self.max_tokens} ({self.num_batches}); resume with the same dataset and "
                              "max_tokens")
        self._order.load_state_dict(state)
