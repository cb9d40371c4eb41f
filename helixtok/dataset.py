"""MemmapChunkDataset: a map-style torch Dataset over built shards, memory-mapped lazily per process."""

from __future__ import annotations

import bisect
import os
from collections.abc import Sequence

import numpy as np

from . import require_torch

torch = require_torch()
from torch.utils.data import Dataset  # noqa: E402

from .errors import DatasetError
from .manifest import DTYPES, MANIFEST, load_manifest, split_entry
from .objstore import is_url, redact
from .shards import DOCS_DTYPE, VALID_DTYPE

IGNORE_INDEX = -100  # what torch's cross_entropy ignores by default
BATCH_KEYS = ("cu_seqlens", "max_seqlen")  # describe a whole batch, not one sample
FIELDS = ("input_ids", "labels", "attention_mask")


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    # Every build writes new files (temp + rename), so a rebuilt shard has a new inode.
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class ChunkBatch(Sequence):
    """What __getitems__ returns: a sequence of per-sample dicts (made on access, so
    default_collate works) over the whole batch, which `collate` hands over as is."""

    def __init__(self, batch: dict, n: int):
        self.batch = batch
        self._n = n
        self._samples: list[dict] | None = None

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, j):
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(self._n))]
        if self._samples is None:  # default_collate asks for every sample: make all views at once
            keys = [k for k in self.batch if k not in BATCH_KEYS]
            self._samples = [dict(zip(keys, row)) for row in zip(*(self.batch[k].unbind(0) for k in keys))]
        return self._samples[j]


def collate(samples):
    """collate_fn for DataLoader: a ChunkBatch's batch as is; anything else via default_collate."""
    if isinstance(samples, ChunkBatch):
        return samples.batch
    from torch.utils.data import default_collate

    return default_collate(samples)


class MemmapChunkDataset(Dataset):
    """Chunks of `seq_len` token ids from a helixtok build.

    `ds[i]` is a dict of LongTensors[seq_len]: input_ids, labels (= input_ids, -100 on padding;
    the model shifts them) and attention_mask (0 on padding).

    shifted=True (packed data only) gives next-token pairs without wasting a token: input_ids
    are chunk i, labels the same window moved one token on, borrowing the first token of chunk
    i+1 (labels are already shifted: do not shift again).  The last chunk's last label is -100.

    position_ids=True (packed data only) adds position ids that restart at every document,
    from the per-shard document index (never from scanning for EOS).

    document_masking=True (packed data only) also adds `document_ids` (per token, for a
    FlexAttention mask_mod or helixtok.masking.block_causal_mask), and to batches made by
    `collate` (DataLoader(collate_fn=ds.collate)) `cu_seqlens`/`max_seqlen` over the flattened
    batch for flash-attention varlen; see docs/training.md.

    tokenizer: a tokenizer.json path (or folder); the dataset refuses shards built with another.

    fields: which of input_ids, labels, attention_mask to return (all three by default); a loop
    that shifts input_ids itself can take ("input_ids",) and skip building the other two.
    """

    def __init__(self, path: str, split: str = "train", *, tokenizer: str | None = None,
                 shifted: bool = False, position_ids: bool = False, document_masking: bool = False,
                 fields: Sequence[str] = FIELDS):
        self.path = os.fspath(path)
        self.split = split
        self.fields = tuple(fields)
        # Where input_ids, labels and attention_mask sit in a batch's one buffer (None: not asked for).
        self._slots = tuple(self.fields.index(f) if f in self.fields else None for f in FIELDS)
        if "input_ids" not in self.fields or not set(self.fields) <= set(FIELDS) or \
                len(set(self.fields)) != len(self.fields):
            raise DatasetError(f"fields={self.fields!r}: give input_ids and any of labels, attention_mask, "
                               "each once")
        if is_url(self.path):
            raise DatasetError(f"{redact(self.path)}: memory-mapping needs the shards on local disk; copy them "
                               f"first: helixtok pull {redact(self.path)} /local/dir (docs/scale.md)")
        try:
            before = _identity(os.stat(os.path.join(self.path, MANIFEST)))
        except OSError:
            before = None  # load_manifest says what is wrong
        m = load_manifest(self.path)
        s = split_entry(m, split, self.path)
        self.seq_len = int(m["seq_len"])
        self.packing = m["packing"]
        self.dtype = np.dtype(DTYPES[m["dtype"]])
        self.pad_id = int(m["tokenizer"]["pad_id"])
        self.eos_id = int(m["tokenizer"]["eos_id"])
        self.bos_id = m["tokenizer"].get("bos_id")  # None: the tokenizer names no BOS
        self.vocab_size = int(m["tokenizer"]["vocab_size"])  # largest id + 1: size an embedding table with it
        self.tokenizer_sha256 = m["tokenizer"]["sha256"]
        if (shifted or position_ids or document_masking) and self.packing != "packed":
            raise DatasetError(f"{self.path}: shifted/position_ids/document_masking need packed data; this "
                               f"dataset is {self.packing}-packed")
        if self.packing == "document" and self.fields == ("input_ids",):
            raise DatasetError(f"{self.path}: document-packed chunks end in padding; keep labels or "
                               "attention_mask in fields to know where")
        if shifted and "labels" not in self.fields:
            raise DatasetError("shifted=True makes labels: keep labels in fields")
        self.shifted = shifted
        self.document_masking = document_masking
        self.position_ids = position_ids or document_masking
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)
        self._shards = [(os.path.join(self.path, e["path"]), int(e["num_chunks"]), e) for e in s["shards"]]
        self._check_files()
        # What each file is now: a process that opens them later (a DataLoader worker, a pickled
        # copy after `build --overwrite`) must read these very files or fail, never others.
        self._identity = {p: _identity(os.stat(p)) for p in self._files()}
        if self._identity[os.path.join(self.path, MANIFEST)] != before:
            raise DatasetError(f"{self.path}: the dataset changed while it was being opened; open it again")
        counts = np.array([n for _, n, _ in self._shards], dtype=np.int64)
        self._starts = np.concatenate(([0], np.cumsum(counts)))
        self._starts_list = self._starts.tolist()
        self._len = int(s["num_chunks"])
        if self._starts[-1] != self._len:
            raise DatasetError(f"{self.path}: split {split!r} lists {self._starts[-1]} chunks in its shards "
                               f"but num_chunks is {self._len}; the manifest is corrupt, rebuild")
        self._maps: list | None = None

    # ---------------------------------------------------------------- checks

    def _check_tokenizer(self, tokenizer: str) -> None:
        from .tokenizer import resolve_tokenizer_path, sha256_file

        p = resolve_tokenizer_path(os.fspath(tokenizer))
        got = sha256_file(p)
        if got != self.tokenizer_sha256:
            raise DatasetError(f"{self.path} was built with tokenizer sha256 {self.tokenizer_sha256[:12]}…, "
                               f"but {p} has sha256 {got[:12]}…; use the tokenizer the data was built with "
                               f"(a copy is in {os.path.join(self.path, 'tokenizer.json')})")

    def _check_files(self) -> None:
        row = self.seq_len * self.dtype.itemsize
        for p, n, e in self._shards:
            if not os.path.isfile(p):
                raise DatasetError(f"{p}: shard missing; copy it again or rebuild")
            size = os.path.getsize(p)
            if size != n * row:
                raise DatasetError(f"{p}: {size} bytes, the manifest says {n} chunks x {self.seq_len} x "
                                   f"{self.dtype.itemsize} = {n * row} bytes (truncated copy or wrong dtype?); "
                                   "copy it again or rebuild")
            side = "valid" if self.packing == "document" else "docs"
            if side in e:
                sp = os.path.join(self.path, e[side]["path"])
                want = n * VALID_DTYPE.itemsize if side == "valid" else e[side]["count"] * DOCS_DTYPE.itemsize
                if not os.path.isfile(sp) or os.path.getsize(sp) != want:
                    raise DatasetError(f"{sp}: missing or not {want} bytes as the manifest says; copy it again")

    # ---------------------------------------------------------------- memmaps (lazy, per process)

    @property
    def manifest(self) -> dict:
        """The dataset's manifest.json (docs/format.md), read when first asked for (never pickled)."""
        if self.__dict__.get("_manifest") is None:
            self._manifest = load_manifest(self.path)
        return self._manifest

    def __getstate__(self):
        # Pickling a memmap would copy its data into every DataLoader worker: send paths only.
        d = self.__dict__.copy()
        d["_maps"] = None
        d.pop("_manifest", None)
        return d

    def _files(self) -> list[str]:
        side = "valid" if self.packing == "document" else "docs"
        return [os.path.join(self.path, MANIFEST)] + [q for p, _, e in self._shards
                                                      for q in (p, os.path.join(self.path, e[side]["path"]))]

    def _checked(self, p: str):
        """Open p, refusing a file that is not the one this dataset was created over."""
        try:
            fh = open(p, "rb")
        except FileNotFoundError:
            fh = None
        if fh is None or _identity(os.fstat(fh.fileno())) != self._identity[p]:
            if fh is not None:
                fh.close()
            raise DatasetError(f"{p}: changed since this MemmapChunkDataset was created (dataset rebuilt, "
                               "replaced or deleted?); create the dataset and its DataLoader again")
        return fh

    def _open(self) -> list:
        self._checked(os.path.join(self.path, MANIFEST)).close()
        maps = []
        for p, n, e in self._shards:
            with self._checked(p) as fh:
                # A plain ndarray over the map: np.memmap's Python-level __getitem__ costs ~10 us a batch.
                mm = np.memmap(fh, dtype=self.dtype, mode="r", shape=(n, self.seq_len)).view(np.ndarray)
            side = None
            if self.packing == "document":
                with self._checked(os.path.join(self.path, e["valid"]["path"])) as fh:
                    side = np.memmap(fh, dtype=VALID_DTYPE, mode="r", shape=(n,))
            elif self.position_ids:
                with self._checked(os.path.join(self.path, e["docs"]["path"])) as fh:
                    side = np.fromfile(fh, dtype=DOCS_DTYPE).astype(np.int64)
            maps.append((mm, side))
        self._maps = maps
        return maps

    def __len__(self) -> int:
        return self._len

    def _index(self, indices) -> tuple[list[int] | np.ndarray, int, int]:
        """(indices with negatives counted from the end, min, max); IndexError names the first index
        out of range.  A DataLoader batch, a short list of ints, stays a list: numpy's conversion and
        reductions cost more than the rest of a batch's bookkeeping."""
        if type(indices) is list and len(indices) <= 64 and all(type(i) is int for i in indices):
            if not indices:
                return np.empty(0, np.int64), 0, 0
            idx, lo, hi = indices, min(indices), max(indices)
            if lo < 0:
                idx = [i + self._len if i < 0 else i for i in indices]
                lo, hi = min(idx), max(idx)
            if lo >= 0 and hi < self._len:
                return idx, lo, hi
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not len(idx):
            return idx, 0, 0
        idx = np.where(idx < 0, idx + self._len, idx)
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= self._len:
            bad = int(idx[(idx < 0) | (idx >= self._len)][0])
            raise IndexError(f"index {bad - self._len if bad < 0 else bad} out of range for {self._len} chunks")
        return idx, lo, hi

    def _locate(self, idx, lo: int, hi: int) -> tuple[int | np.ndarray, list[int] | np.ndarray]:
        """(shard, row in shard) of in-range indices (min lo, max hi); shard is one int when all lie
        in one shard."""
        first = bisect.bisect_right(self._starts_list, lo) - 1
        if first == bisect.bisect_right(self._starts_list, hi) - 1:
            base = self._starts_list[first]
            if not base:
                return first, idx
            return first, [i - base for i in idx] if type(idx) is list else idx - base
        idx = np.asarray(idx, dtype=np.int64)
        shard = np.searchsorted(self._starts, idx, side="right") - 1
        return shard, idx - self._starts[shard]

    def _gather(self, shard, local, out: np.ndarray, column: int | str | None = None) -> None:
        """out[j] = row local[j] of shard[j]: the whole row, one column of it, or (column="side")
        its sidecar value."""
        maps = self._maps or self._open()
        if type(local) is list:  # a DataLoader batch in one shard: one copy a row into `out`, no fancy index
            mm, side = maps[shard]
            src = side if column == "side" else mm if column is None else mm[:, column]
            for j, r in enumerate(local):
                out[j] = src[r]
            return
        if isinstance(shard, int):
            parts = [(shard, slice(None), local)]
        elif len(local) <= 64:  # a few rows: one copy each beats np.unique's and np.nonzero's fixed costs
            parts = zip(shard.tolist(), range(len(local)), local.tolist())
        else:
            parts = [(int(s), sel, local[sel]) for s in np.unique(shard) for sel in [np.nonzero(shard == s)[0]]]
        for s, sel, rows in parts:
            mm, side = maps[s]
            out[sel] = side[rows] if column == "side" else mm[rows] if column is None else mm[rows, column]

    def _next_tokens(self, idx) -> np.ndarray:
        """The first token of the chunk after each of idx; -100 after the last chunk."""
        nxt = np.asarray(idx, dtype=np.int64) + 1
        last = nxt >= self._len
        nxt[last] = 0
        out = np.empty(len(idx), dtype=np.int64)
        if len(idx):
            self._gather(*self._locate(nxt, int(nxt.min()), int(nxt.max())), out, column=0)
        out[last] = IGNORE_INDEX
        return out

    def document_starts(self, i: int) -> np.ndarray:
        """Offsets inside chunk i where a document begins (packed data; needs position_ids=True)."""
        if not self.position_ids:
            raise DatasetError("document_starts needs MemmapChunkDataset(..., position_ids=True)")
        maps = self._maps or self._open()
        shard, local = self._locate(*self._index([i]))
        starts = maps[int(shard)][1]
        lo = int(local[0]) * self.seq_len
        a, b = np.searchsorted(starts, [lo, lo + self.seq_len])
        return starts[a:b] - lo

    def _batch(self, idx, lo: int, hi: int) -> dict:
        shard, local = self._locate(idx, lo, hi)
        L = self.seq_len
        # One allocation for all fields: a DataLoader worker moves each storage it returns into
        # shared memory, one segment per storage (measured: 1.7 ms a batch for three, 0.8 for one).
        buf = np.empty((len(self.fields), len(idx), L), dtype=np.int64)
        # labels are their own rows: editing them leaves input_ids alone
        ids, labels, mask = (None if k is None else buf[k] for k in self._slots)
        self._gather(shard, local, ids)
        pad = None
        if self.packing == "document":
            valid = np.empty(len(idx), dtype=np.int64)
            self._gather(shard, local, valid, column="side")
            pad = np.arange(L)[None, :] >= valid[:, None]
        if labels is not None:
            if self.shifted:
                labels[:, :-1] = ids[:, 1:]
                labels[:, -1] = self._next_tokens(idx)
            else:
                labels[:] = ids
                if pad is not None:
                    labels[pad] = IGNORE_INDEX
        if mask is not None:
            if pad is None:
                mask.fill(1)
            else:
                np.logical_not(pad, out=mask, casting="unsafe")
        b = dict(zip(self.fields, torch.from_numpy(buf).unbind(0)))
        if self.position_ids:
            from .masking import boundaries

            bd = boundaries([self.document_starts(i) for i in np.asarray(idx).tolist()], L)
            b["position_ids"] = bd["position_ids"]
            if self.document_masking:
                b.update(document_ids=bd["document_ids"], cu_seqlens=bd["cu_seqlens"], max_seqlen=bd["max_seqlen"])
        return b

    def __getitem__(self, i: int) -> dict:
        b = self._batch(*self._index([int(i)]))
        return {k: v[0] for k, v in b.items() if k not in BATCH_KEYS}

    collate = staticmethod(collate)

    def __getitems__(self, indices) -> ChunkBatch:
        # DataLoader calls this with a whole batch of indices: one fancy index per shard.
        idx, lo, hi = self._index(indices)
        return ChunkBatch(self._batch(idx, lo, hi), len(idx))

    def __repr__(self) -> str:
        return (f"MemmapChunkDataset({self.path!r}, split={self.split!r}, chunks={self._len}, "
                f"seq_len={self.seq_len}, dtype={self.dtype.name}, packing={self.packing})")
