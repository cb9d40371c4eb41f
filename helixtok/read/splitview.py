"""A split's shards read as one token stream cut into chunks: what show, verify, info and the exports index."""

from __future__ import annotations

import bisect
import os

import numpy as np

from ..format.bestfit import CHUNK_DTYPE, ITEM_DTYPE, Index, load_index
from ..format.errors import ConfigError, DatasetError
from ..format.manifest import DTYPES, check_small_file, shard_tokens, split_entry
from ..format.shards import DOCS_DTYPE, MASK_DTYPE, SRC_DTYPE, VALID_DTYPE
from .layout import Pieces, bestfit_pieces


class SplitView:
    """Chunk i of a split is tokens [i*L, (i+1)*L) of its shards concatenated (packed: a chunk may
    span shards, and the stream's last partial chunk belongs to none; document shards hold whole
    chunks), or (bestfit) the pieces of the stream its index names, then padding.  Local files are
    mapped when first read; `root` may also be an objstore.Folder (a URL: tokens are read with seeks)."""

    def __init__(self, root, m: dict, split: str = "train"):
        self.folder = root if not isinstance(root, (str, os.PathLike)) else None
        self.root, self.m = (root.root if self.folder else os.fspath(root)), m
        self.s, self.split = split_entry(m, split, root), split
        self.L = int(m["seq_len"])
        self.dtype = np.dtype(DTYPES[m["dtype"]])
        self.shards = self.s["shards"]
        self.starts = np.concatenate(([0], np.cumsum([shard_tokens(e, self.L) for e in self.shards]))).astype(np.int64)
        self._starts = self.starts.tolist()
        self.num_chunks = int(self.s["num_chunks"])
        if m["packing"] != "bestfit" and self.num_chunks * self.L > self._starts[-1]:  # (bestfit: its index says)
            raise DatasetError(f"{self.root}: its {split} shards hold {self._starts[-1]:,} tokens, fewer than its "
                               f"{self.num_chunks:,} chunks of {self.L} need: the manifest is damaged (a shard's "
                               "num_tokens?); copy the dataset again or rebuild it")
        self.pad_id = int(m["tokenizer"]["pad_id"])
        self._maps: dict[tuple[int, str], np.ndarray] = {}
        self._pieces: Pieces | None = None

    def _read(self, path: str, want: int) -> bytes:
        """A whole (small) file of the dataset, refused unless it has the manifest's size."""
        if self.folder is not None:
            size = self.folder.size(path)
            data = None
            if size == want:
                with self.folder.open(path) as fh:
                    data = fh.read()
        else:
            p = os.path.join(self.root, path)
            size = os.path.getsize(p) if os.path.isfile(p) else None
            data = None
            if size == want:
                with open(p, "rb") as fh:
                    data = fh.read()
        if data is None or len(data) != want:
            raise DatasetError(f"{os.path.join(self.root, path)}: {'missing or not a file' if size is None else f'{size} bytes'}"
                               f", the manifest says {want}; copy the dataset again or rebuild it "
                               "(helixtok verify says more)")
        return data

    def bestfit_index(self) -> Index:
        """A bestfit split's index (its two files, read whole)."""
        x = self.s["index"]
        size = {x["items"]["path"]: x["items"]["count"] * 2 * ITEM_DTYPE.itemsize,
                x["chunks"]["path"]: (self.num_chunks + 1) * CHUNK_DTYPE.itemsize}
        return load_index(lambda p: self._read(p, size[p]), x, self.L, self._starts[-1], self.root)

    def pieces(self) -> Pieces | None:
        """Where a bestfit split's chunks lie (None: chunks are cut from the stream in order)."""
        if self.m["packing"] == "bestfit" and self._pieces is None:
            self._pieces = bestfit_pieces(self.bestfit_index())
        return self._pieces

    def _want(self, k: int, side: str) -> int:
        """The bytes shard k's file `side` holds by the manifest (the checks MemmapChunkDataset makes)."""
        e, n = self.shards[k], shard_tokens(self.shards[k], self.L)
        if side == "bin":
            return n * self.dtype.itemsize
        if side == "docs":
            return int(e["docs"]["count"]) * DOCS_DTYPE.itemsize
        if side == "mask":
            return n * MASK_DTYPE.itemsize
        if side == "src":
            return int(e["docs"]["count"]) * SRC_DTYPE.itemsize
        return n // self.L * VALID_DTYPE.itemsize

    def _map(self, k: int, side: str = "bin") -> np.ndarray:
        if (k, side) not in self._maps:
            e = self.shards[k]
            path = os.path.join(self.root, e["path"] if side == "bin" else e[side]["path"])
            dtype = {"bin": self.dtype, "docs": DOCS_DTYPE, "valid": VALID_DTYPE, "mask": MASK_DTYPE, "src": SRC_DTYPE}[side]
            # A file of another size (truncated, a link to /dev/zero, a wrong num_tokens) is named,
            # never read past or short.
            size = os.path.getsize(path) if os.path.isfile(path) else None
            if size != self._want(k, side):
                raise DatasetError(f"{path}: {'missing or not a file' if size is None else f'{size} bytes'}, the "
                                   f"manifest says {self._want(k, side)}; copy the dataset again or rebuild it "
                                   "(helixtok verify says more)")
            mapped = np.memmap(path, dtype=dtype, mode="r") if size else np.empty(0, dtype)
            if side not in ("bin", "mask"):  # the mask is as large as the ids / itemsize: verify hashes it
                check_small_file(path, memoryview(mapped), e[side].get("sha256"))
            self._maps[(k, side)] = mapped
        return self._maps[(k, side)]

    def _slice(self, k: int, a: int, b: int, side: str = "bin") -> np.ndarray:
        if self.folder is not None and self.folder.fs is not None:
            e = self.shards[k]
            path, dtype = (e["path"], self.dtype) if side == "bin" else (e[side]["path"], MASK_DTYPE)
            with self.folder.open(path) as fh:
                fh.seek(a * dtype.itemsize)
                got = np.frombuffer(fh.read((b - a) * dtype.itemsize), dtype=dtype)
            if len(got) != b - a:
                raise DatasetError(f"{path}: shorter than the manifest says; copy the dataset again or rebuild it")
            return got
        return np.asarray(self._map(k, side)[a:b])

    def _check(self, i: int) -> None:
        if not 0 <= i < self.num_chunks:
            raise ConfigError(f"chunk {i} outside [0, {self.num_chunks}) of this split")

    def tokens(self, a: int, b: int, side: str = "bin") -> np.ndarray:
        """Tokens [a, b) of the stream (side="mask": a chat build's mask of them)."""
        parts = []
        k = bisect.bisect_right(self._starts, a) - 1
        while a < b:
            s0, s1 = self._starts[k], self._starts[k + 1]
            take = min(b, s1) - a
            if take > 0:
                parts.append(self._slice(k, a - s0, a - s0 + take, side))
                a += take
            k += 1
        return np.concatenate(parts) if len(parts) != 1 else parts[0]

    def chunk(self, i: int, side: str = "bin") -> np.ndarray:
        """Chunk i's ids (side="mask": a chat build's mask of them, 0 on padding)."""
        self._check(i)
        lay = self.pieces()
        if lay is None:
            return self.tokens(i * self.L, (i + 1) * self.L, side)
        row = np.full(self.L, self.pad_id, self.dtype) if side == "bin" else np.zeros(self.L, MASK_DTYPE)
        at = 0
        for g, n in zip(*lay.pieces(i)):
            row[at: at + n] = self.tokens(g, g + n, side)
            at += n
        return row

    def chunk_starts(self, i: int) -> np.ndarray:
        """Offsets in chunk i where a document (bestfit: an item) starts."""
        self._check(i)
        lay = self.pieces()
        if lay is not None:
            return lay.document_starts(i)
        return self.starts_in(i * self.L, (i + 1) * self.L) - i * self.L

    def starts_in(self, a: int, b: int) -> np.ndarray:
        """Stream positions in [a, b) where a document (bestfit: a piece) starts (the .docs sidecars)."""
        out = []
        k = bisect.bisect_right(self._starts, a) - 1
        while k < len(self.shards) and self._starts[k] < b:
            base = self._starts[k]
            offs = self._map(k, "docs")  # searched as stored: only the slice found is converted
            lo, hi = np.searchsorted(offs, np.array([max(0, a - base), b - base], DOCS_DTYPE))
            out.append(offs[lo:hi].astype(np.int64) + base)
            k += 1
        return np.concatenate(out) if out else np.empty(0, np.int64)

    def starts_before(self, pos: int) -> int:
        """How many document starts lie before stream position `pos`."""
        k = bisect.bisect_right(self._starts, pos) - 1
        before = sum(int(e["docs"]["count"]) for e in self.shards[:k])
        return before + (int(np.searchsorted(self._map(k, "docs"), pos - self._starts[k])) if k < len(self.shards) else 0)

    def document_source(self, doc: int) -> str | None:
        """Where document `doc` of the split (in stream order) was read, from its .src entry and the
        manifest (format.manifest.DocumentSources); None for a dataset written without them."""
        k = self._place(doc) if self._sources().known else None
        return None if k is None else self._sources()(doc, k)

    def document_fields(self, doc: int) -> dict | None:
        """The --keep-fields its record had (format/fields.py), or None (none kept, or none there)."""
        from ..format.fields import DocumentFields
        from ..format.objstore import Folder

        if self.__dict__.get("_fields") is None:
            self._fields = DocumentFields(self.m, (self.folder or Folder(self.root)).read_range)
        k = self._place(doc) if self._fields.known else None
        return None if k is None else self._fields(self._sources().unit_of(doc), k)

    def _sources(self):
        """The split's format.manifest.DocumentSources (made once)."""
        from ..format.manifest import DocumentSources

        if self.__dict__.get("_where") is None:
            self._where = DocumentSources(self.m, self.split)
        return self._where

    def _place(self, doc: int) -> int | None:
        """Document `doc`'s .src entry: its place in its work unit; None without .src sidecars."""
        if self.__dict__.get("_doc_ends") is None:
            self._doc_ends = np.cumsum([int(e["docs"]["count"]) for e in self.shards])
        if not all("src" in e for e in self.shards):
            return None
        k = int(np.searchsorted(self._doc_ends, doc, side="right"))
        if k >= len(self.shards):
            return None
        return int(self._map(k, "src")[doc - (int(self._doc_ends[k - 1]) if k else 0)])

    def valid(self, i: int) -> int:
        """Real tokens at the start of chunk i (the rest is padding); seq_len for packed data."""
        self._check(i)
        if self.m["packing"] == "packed":
            return self.L
        if self.pieces() is not None:
            return int(self._pieces.filled[i])
        k = bisect.bisect_right(self._starts, i * self.L) - 1
        return int(self._map(k, "valid")[i - self._starts[k] // self.L])

    def all_valid(self) -> np.ndarray:
        if self.pieces() is not None:
            return self._pieces.filled
        return np.concatenate([np.asarray(self._map(k, "valid")) for k in range(len(self.shards))]
                              or [np.empty(0, VALID_DTYPE)])

    def document_lengths(self) -> np.ndarray:
        """Tokens of each document of a packed split (EOS included); the last one ends where the
        stream does (the tokens on disk: a version 1 build kept no partial chunk)."""
        end = self._starts[-1]
        st = self.starts_in(0, end)
        if len(st) == 0 or st[0] != 0:
            st = np.concatenate(([0], st))
        return np.diff(np.append(st, end))

    def iter_stream(self, step: int = 1 << 22):
        """The whole stream on disk, in slices of at most `step` tokens."""
        for k in range(len(self.shards)):
            mm = self._map(k)
            for a in range(0, len(mm), step):
                yield np.asarray(mm[a: a + step])
