"""MemmapChunkDataset: a map-style torch Dataset over built shards, memory-mapped lazily per process."""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import posixpath
from collections.abc import Sequence

import numpy as np

from . import require_torch

torch = require_torch()
from torch.utils.data import Dataset  # noqa: E402

from ..format.bestfit import CHUNK_DTYPE, ITEM_DTYPE, doc_spans, load_index
from ..format.errors import DatasetError
from ..format.manifest import (DTYPES, INDEX_FILES, MANIFEST, SIDES, check_small_file, load_manifest, read_seq_len,
                               shard_tokens, sides_of, split_entry, split_files)
from ..format.objstore import READ_STALL_SECONDS, filesystem, is_url, redact, stall_bound
from ..format.shards import DOCS_DTYPE, MASK_DTYPE, SRC_DTYPE, VALID_DTYPE
from .blockcache import DEFAULT_BLOCK_BYTES, BlockArray, BlockCache, parse_limit, plan_blocks
from .layout import Pieces, bestfit_pieces, shuffled_documents
from .sizes import parse_bytes

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
    """collate_fn for DataLoader: a ChunkBatch's batch as is; anything else via default_collate,
    and samples with document masks (ds[i] of document_masking=True) get the batch's
    `cu_seqlens`/`max_seqlen` as the DataLoader path has them (from where position_ids restart)."""
    if isinstance(samples, ChunkBatch):
        return samples.batch
    from torch.utils.data import default_collate

    out = default_collate(samples)
    if isinstance(out, dict) and "document_ids" in out and "position_ids" in out:
        from .masking import boundaries

        pos = out["position_ids"].numpy()
        bd = boundaries([np.flatnonzero(row == 0) for row in pos], pos.shape[1])
        out["cu_seqlens"], out["max_seqlen"] = bd["cu_seqlens"], bd["max_seqlen"]
    return out


class MemmapChunkDataset(Dataset):
    """Chunks of `seq_len` token ids from a helixtok build.

    `ds[i]` is a dict of LongTensors[seq_len]: input_ids, labels (= input_ids, -100 on padding;
    the model shifts them) and attention_mask (0 on padding).

    shifted=True (packed data only) gives next-token pairs without wasting a token: input_ids
    are chunk i, labels the same window moved one token on, borrowing the first token of chunk
    i+1 (labels are already shifted: do not shift again).  The last chunk's last label is -100.

    position_ids=True (packed and bestfit data) adds position ids that restart at every document,
    from the per-shard document index (never from scanning for EOS); a bestfit chunk's padding
    counts as one more document.

    document_masking=True (packed and bestfit data) also adds `document_ids` (per token, for a
    FlexAttention mask_mod or helixtok.read.masking.block_causal_mask), and to batches made by
    `collate` (DataLoader(collate_fn=ds.collate)) `cu_seqlens`/`max_seqlen` over the flattened
    batch for flash-attention varlen; see docs/training.md.

    tokenizer: a tokenizer.json path (or folder); the dataset refuses shards built with another.

    fields: which of input_ids, labels, attention_mask to return (all three by default); a loop
    that shifts input_ids itself can take ("input_ids",) and skip building the other two.

    repack=True (packed and bestfit data) gives every epoch its own packing, a function of (seed,
    epoch): packed, the split's documents shuffled and cut every seq_len tokens (as many chunks
    every epoch); bestfit, the items of every chunk in a new order.  The epoch is the one of
    `set_epoch` (0 at first), or given with each index: `ds[(epoch, i)]`, which is what
    ChunkSampler yields for a dataset that repacks (DataLoader workers then need no set_epoch).

    A chat build (`build --chat`): labels are -100 wherever its mask says a token does not train.

    seq_len (packed data): read the stream in chunks of another length than the build's -- a
    sequence-length curriculum without tokenizing again; len() is exact (the stream's tokens //
    seq_len), the items are a packed build's at that length.

    path may be a URL (a dataset `push`ed to object storage) with cache_dir: the ids are read in
    place through a node-local cache of at most cache_limit bytes (blockcache.py), in blocks of
    block_bytes; ChunkSampler(shuffle="block") is the order that reads each block once an epoch
    (docs/scale.md).  Every request to the storage waits at most stall_timeout s for an answer
    (reads are asked again within it), then raises StorageError naming the URL: a stalled server
    fails the DataLoader instead of holding it.
    """

    def __init__(self, path: str, split: str = "train", *, tokenizer: str | None = None,
                 shifted: bool = False, position_ids: bool = False, document_masking: bool = False,
                 fields: Sequence[str] = FIELDS, repack: bool = False, seed: int = 0,
                 cache_dir: str | None = None, cache_limit: int | str | None = None,
                 block_bytes: int | str = DEFAULT_BLOCK_BYTES, stall_timeout: float = READ_STALL_SECONDS,
                 seq_len: int | None = None):
        self.path = os.fspath(path)
        if not stall_timeout > 0:
            raise DatasetError(f"stall_timeout must be positive seconds, got {stall_timeout!r}")
        self.stall_timeout = float(stall_timeout)
        self.split = split
        self.fields = tuple(fields)
        # Where input_ids, labels and attention_mask sit in a batch's one buffer (None: not asked for).
        self._slots = tuple(self.fields.index(f) if f in self.fields else None for f in FIELDS)
        if "input_ids" not in self.fields or not set(self.fields) <= set(FIELDS) or \
                len(set(self.fields)) != len(self.fields):
            raise DatasetError(f"fields={self.fields!r}: give input_ids and any of labels, attention_mask, "
                               "each once")
        self.remote = is_url(self.path)
        if self.remote and cache_dir is None:
            raise DatasetError(f"{redact(self.path)}: reading from object storage needs a node-local cache_dir "
                               "(and a cache_limit): blocks are fetched there and shared by every process "
                               f"(docs/scale.md); or copy it first: helixtok pull {redact(self.path)} /local/dir")
        try:
            before = None if self.remote else _identity(os.stat(os.path.join(self.path, MANIFEST)))
        except OSError:
            before = None  # load_manifest says what is wrong
        with stall_bound(self.stall_timeout):
            m = load_manifest(self.path)
        s = split_entry(m, split, self.path)
        # What the dataset is, whatever folder it is in: a mixture's checkpoint records it (identity()).
        self.manifest_sha256 = hashlib.sha256(json.dumps(m, sort_keys=True).encode()).hexdigest()
        built = int(m["seq_len"])
        self.packing = m["packing"]
        self.seq_len, chunks = read_seq_len(m, s, seq_len, self.path)
        self._built_seq_len = built
        self.dtype = np.dtype(DTYPES[m["dtype"]])
        self.pad_id = int(m["tokenizer"]["pad_id"])
        self.eos_id = int(m["tokenizer"]["eos_id"])
        self.bos_id = m["tokenizer"].get("bos_id")  # None: the tokenizer names no BOS
        self.vocab_size = int(m["tokenizer"]["vocab_size"])  # largest id + 1: size an embedding table with it
        self.tokenizer_sha256 = m["tokenizer"]["sha256"]
        # A chat build: a mask per token says which train; labels are -100 where it is 0.
        self.chat = bool(m.get("chat"))
        self._all_sides = sides_of(m)
        if shifted and self.packing != "packed":
            raise DatasetError(f"{self.path}: shifted needs packed data (one stream); this dataset is "
                               f"{self.packing}-packed")
        if (position_ids or document_masking) and self.packing == "document":
            raise DatasetError(f"{self.path}: position_ids/document_masking need packed or bestfit data; each "
                               "chunk of this document-packed dataset holds one document already")
        if repack and self.packing == "document":
            raise DatasetError(f"{self.path}: repack needs packed or bestfit data (a document-packed chunk holds "
                               "one document: shuffle with ChunkSampler)")
        self.repack, self.seed, self.epoch = repack, seed, 0
        self._padded = self.packing != "packed"  # chunks end in padding (.valid or the bestfit index says where)
        if self._padded and self.fields == ("input_ids",):
            raise DatasetError(f"{self.path}: {self.packing}-packed chunks end in padding; keep labels or "
                               "attention_mask in fields to know where")
        if shifted and "labels" not in self.fields:
            raise DatasetError("shifted=True makes labels: keep labels in fields")
        self.shifted = shifted
        self.document_masking = document_masking
        self.position_ids = position_ids or document_masking
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)
        self._shards = [(os.path.join(self.path, e["path"]), shard_tokens(e, built), e) for e in s["shards"]]
        self._index_paths = {k: os.path.join(self.path, s["index"][k]["path"]) for k in INDEX_FILES} \
            if self.packing == "bestfit" else {}
        self._index_entry = s.get("index") if self._index_paths else None  # its manifest entry
        self._len = chunks
        # Object storage: the token bytes in blocks (blockcache.py), each checked by the segments'
        # digests the build recorded; the small files fetched whole and checked by their sha256.
        self.block_bytes = parse_bytes(block_bytes)
        self._blocks = [plan_blocks(e, self.block_bytes) for _, _, e in self._shards]
        self._cache = None
        if self.remote:
            self._remote_files = {x["path"]: x for x in split_files(s)}
            self._cache = BlockCache(self.path, os.fspath(cache_dir), self.manifest_sha256[:16], parse_limit(cache_limit),
                                     self.block_bytes, self.stall_timeout)
            self._check_remote_files()
            self._identity = {}
        else:
            self._check_files(s)
            # What each file is now: a process that opens them later (a DataLoader worker, a pickled
            # copy after `build --overwrite`) must read these very files or fail, never others.
            self._identity = {p: _identity(os.stat(p)) for p in self._files()}
            if self._identity[os.path.join(self.path, MANIFEST)] != before:
                raise DatasetError(f"{self.path}: the dataset changed while it was being opened; open it again")
        # Where each shard's tokens begin in the split's stream: chunk i is tokens [i*L, (i+1)*L)
        # (a packed chunk may span shards; document shards hold whole chunks; bestfit chunks are
        # gathered from the pieces its index names).
        self._starts = np.concatenate(([0], np.cumsum([n for _, n, _ in self._shards]))).astype(np.int64)
        self._starts_list = self._starts.tolist()
        if self.packing != "bestfit" and self._starts[-1] // self.seq_len != self._len:
            raise DatasetError(f"{self.path}: split {split!r} holds {self._starts[-1] // self.seq_len} chunks in its "
                               f"shards but num_chunks is {self._len}; the manifest is corrupt, rebuild")
        self._maps: list | None = None
        self._layouts: dict = {}  # epoch -> layout.Pieces (bestfit, repack), built once per process

    # ---------------------------------------------------------------- checks

    def _check_tokenizer(self, tokenizer: str) -> None:
        from ..format.tokenizer_file import resolve_tokenizer_path, sha256_file

        p = resolve_tokenizer_path(os.fspath(tokenizer))
        got = sha256_file(p)
        if got != self.tokenizer_sha256:
            raise DatasetError(f"{self.path} was built with tokenizer sha256 {self.tokenizer_sha256[:12]}…, "
                               f"but {p} has sha256 {got[:12]}…; use the tokenizer the data was built with "
                               f"(a copy is in {os.path.join(self.path, 'tokenizer.json')})")

    def _sides(self) -> tuple[str, ...]:
        """The sidecars this dataset reads per shard (a bestfit split's are read once, into its index)."""
        return tuple(x for x in SIDES[self.packing]
                     if x == "valid" or (self.position_ids or self.repack) and self.packing == "packed") + \
            (("mask",) if self.chat and "labels" in self.fields else ())

    def _check_files(self, s: dict) -> None:
        for k, p in self._index_paths.items():
            want = (s["index"]["items"]["count"] * 2 * ITEM_DTYPE.itemsize if k == "items" else
                    (self._len + 1) * CHUNK_DTYPE.itemsize)
            if not os.path.isfile(p) or os.path.getsize(p) != want or s["index"][k]["bytes"] != want:
                raise DatasetError(f"{p}: missing or not {want} bytes as the manifest says; copy it again or rebuild")
        size_of = {"valid": lambda n, e: n // self.seq_len * VALID_DTYPE.itemsize,
                   "docs": lambda n, e: e["docs"]["count"] * DOCS_DTYPE.itemsize,
                   "mask": lambda n, e: n * MASK_DTYPE.itemsize,
                   "src": lambda n, e: e["docs"]["count"] * SRC_DTYPE.itemsize}
        for p, n, e in self._shards:
            if not os.path.isfile(p):
                raise DatasetError(f"{p}: shard missing; copy it again or rebuild")
            size = os.path.getsize(p)
            if size != n * self.dtype.itemsize:
                raise DatasetError(f"{p}: {size} bytes, the manifest says {n} tokens x {self.dtype.itemsize} = "
                                   f"{n * self.dtype.itemsize} bytes (truncated copy or wrong dtype?); "
                                   "copy it again or rebuild")
            for side in self._all_sides:
                sp = os.path.join(self.path, e[side]["path"])
                want = size_of[side](n, e)
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
        d["_layouts"] = {}
        d.pop("_manifest", None)
        d.pop("_bestfit", None)
        return d

    def _files(self) -> list[str]:
        return [os.path.join(self.path, MANIFEST), *self._index_paths.values()] + [
            q for p, _, e in self._shards for q in (p, *(os.path.join(self.path, e[x]["path"]) for x in self._all_sides))]

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

    def _read_whole(self, rel: str) -> bytes:
        """A (small) file of the dataset, by its path in the manifest, read whole (_checked; from
        object storage: through the cache, checked by its sha256)."""
        if self.remote:
            x = self._remote_files[rel]
            return self._cache.whole(rel, x.get("sha256"), x["bytes"])
        with self._checked(os.path.join(self.path, rel)) as fh:
            return fh.read()

    def _check_remote_files(self) -> None:
        """Every file the split needs is in object storage at the manifest's size (one listing per folder)."""
        fs = self._cache.fs
        root = filesystem(self.path)[1].rstrip("/")
        sizes = {}
        for folder in sorted({posixpath.dirname(p) for p in self._remote_files}):
            where = f"{root}/{folder}" if folder else root
            try:
                listing = fs.ls(where, detail=True)
            except FileNotFoundError:
                listing = []
            for info in listing:
                sizes[posixpath.relpath(info["name"].rstrip("/"), root)] = int(info.get("size") or 0)
        for rel, x in self._remote_files.items():
            if sizes.get(rel) != x["bytes"]:
                raise DatasetError(f"{redact(self.path)}/{rel}: {'missing' if rel not in sizes else f'{sizes[rel]} bytes'}"
                                   f", the manifest says {x['bytes']}; push the dataset again")

    def _open(self) -> list:
        """Per shard, its ids (mapped; a BlockArray over the cache for a URL) and the sidecars it reads."""
        if not self.remote:
            self._checked(os.path.join(self.path, MANIFEST)).close()
        maps = []
        for (p, n, e), blocks in zip(self._shards, self._blocks):
            ids = BlockArray(self._cache, blocks, n, self.dtype) if self.remote else self._mapped(p, n, self.dtype)
            side = {}
            for x in self._sides():
                if x == "mask" and not self.remote:  # as large as the ids / 4: mapped, not read (size checked)
                    side[x] = self._mapped(os.path.join(self.path, e[x]["path"]), n, MASK_DTYPE)
                    continue
                data = self._read_whole(e[x]["path"])  # (from a URL: checked by its sha256 on the way)
                if not self.remote:
                    check_small_file(os.path.join(self.path, e[x]["path"]), data, e[x].get("sha256"))
                raw = np.frombuffer(data, dtype={"docs": DOCS_DTYPE, "valid": VALID_DTYPE, "mask": MASK_DTYPE, "src": SRC_DTYPE}[x])
                side[x] = raw.astype(np.int64) if x == "docs" else raw
            maps.append((ids, side))
        self._maps = maps
        self._layouts = {}
        if self._index_paths:
            self._bestfit = load_index(self._read_whole, self._index_entry, self.seq_len, int(self._starts[-1]),
                                       self.path)
        return maps

    def _mapped(self, p: str, n: int, dtype) -> np.ndarray:
        """File p (_checked) as n items of dtype: a plain ndarray over the map (np.memmap's
        Python-level __getitem__ costs ~10 us a batch)."""
        with self._checked(p) as fh:
            return np.memmap(fh, dtype=dtype, mode="r", shape=(n,)).view(np.ndarray) if n else np.empty(0, dtype)

    def block_of_chunks(self) -> tuple[np.ndarray, np.ndarray | None]:
        """The chunks grouped by the block (of `block_bytes`, blockcache.py) their first token lies in:
        (bounds, order): block b holds chunks order[bounds[b]:bounds[b+1]] (order None: the chunk
        ids themselves, which lie in stream order: packed and document data).  What
        ChunkSampler(shuffle="block") permutes."""
        firsts = self._block_starts()[0]
        if self.packing == "bestfit":
            self._maps or self._open()
            lay = self._layout(0)
            pos = lay.pos[lay.first[: self._len]]
            block = np.searchsorted(firsts, pos, side="right") - 1
            order = np.argsort(block, kind="stable")
            return np.searchsorted(block[order], np.arange(len(firsts) + 1)), order
        block = np.searchsorted(firsts, np.arange(self._len, dtype=np.int64) * self.seq_len, side="right") - 1
        return np.searchsorted(block, np.arange(len(firsts) + 1)), None

    def fetch_plan(self, *, shuffle: bool | str = "block", window: int = 8, world_size: int = 1,
                   ranks_per_node: int | None = None, seed: int = 0, epoch: int = 0) -> dict:
        """What one epoch reads from object storage per node, before it runs (node 0's; the others
        differ by a block or two).  Block shuffle: the blocks of the node's share of the epoch, each
        fetched once with one GET when cache_limit holds a few windows (8 x window x block_bytes; the
        windows the node's share starts and ends in are counted whole: their chunks are shuffled
        among their blocks;
        a block's tail, the next block's first segment, is fetched again if evicted before that
        block is read: at most one segment a block more).  A global shuffle reads every block for
        every node: with a cache smaller than the data, a chunk whose segment was evicted costs a
        GET of that segment, about chunks x (1 - cache / data) of them ("estimate")."""
        from .sampler import BlockOrder
        from .stats import samples_per_rank

        bounds, _ = self.block_of_chunks()
        sizes = np.asarray([b.segments[-1].end - b.start for bl in self._blocks for b in bl], dtype=np.int64)
        data = int(sizes.sum())
        rpn = world_size if ranks_per_node is None else ranks_per_node
        if shuffle != "block":
            limit = self._cache.limit if self._cache is not None and self._cache.limit is not None else data
            miss = max(0.0, 1.0 - limit / data) if data else 0.0
            seg = data / max(1, sum(len(b.segments) for bl in self._blocks for b in bl))
            return {"shuffle": "global", "blocks": len(sizes), "bytes": int(data + miss * self._len * seg),
                    "gets": int(len(sizes) + miss * self._len), "estimate": True}
        order = BlockOrder(bounds, None, window, seed=seed, epoch=epoch)
        share = rpn * samples_per_rank(self._len, world_size, False)
        a, b = 0, min(share, self._len)
        first = int(np.searchsorted(order.cum, a, side="right")) - 1
        last = int(np.searchsorted(order.cum, b - 1, side="right")) - 1 if b > a else first - 1
        # Whole windows: a window's chunks are shuffled among its blocks, so a share that ends inside
        # one reads from every block of it (counting only the blocks its positions fall in was 2x short).
        if last >= first:
            first, last = first - first % window, min(len(order.perm) - 1, last - last % window + window - 1)
        picked = order.perm[first: last + 1]
        return {"shuffle": "block", "blocks": len(picked), "bytes": int(sizes[picked].sum()), "gets": len(picked),
                "cache_needed": 8 * window * self.block_bytes, "estimate": False}

    @property
    def cache_counts(self) -> dict:
        """This process's reads from object storage: hits, misses, GETs, bytes fetched (empty for local data)."""
        return dict(self._cache.counts) if self._cache is not None else {}

    def prefetch(self, idx) -> None:
        """Start fetching the blocks chunks idx start in (a sampler calls it with what comes next;
        a chunk running into the next block reads only that block's first segment, which a
        block's prefetch brings along: fetching the whole next block here would fetch it twice)."""
        if self._cache is None:
            return
        self._maps or self._open()
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if self.packing == "bestfit":
            lay = self._layout(0)
            g = lay.pos[lay.first[idx]]
        else:
            g = idx * self.seq_len
        firsts, blocks = self._block_starts()
        b = np.searchsorted(firsts, g, side="right") - 1
        _, at = np.unique(b, return_index=True)
        ahead = np.sort(at)[: self._cache.prefetch_blocks]  # the rest stay mapped for what is being read
        self._cache.prefetch([blocks[i] for i in b[ahead].tolist()])

    def _block_starts(self) -> tuple[np.ndarray, list]:
        """Each block's first token in the split's stream, and the blocks, in stream order."""
        if getattr(self, "_block_index", None) is None:
            blocks = [b for bl in self._blocks for b in bl]
            firsts = np.asarray([self._starts[k] + b.start // self.dtype.itemsize
                                 for k, bl in enumerate(self._blocks) for b in bl], dtype=np.int64)
            self._block_index = (firsts, blocks)
        return self._block_index

    def set_epoch(self, epoch: int) -> None:
        """The epoch whose packing plain indices read (repack=True)."""
        self.epoch = int(epoch)

    def _layout(self, epoch: int) -> Pieces | None:
        """Where epoch's chunks lie in the stream: None for a plain cut (packed, document)."""
        if self.packing == "document" or (self.packing == "packed" and not self.repack):
            return None
        if not self.repack:
            epoch = 0
        lay = self._layouts.get(epoch)
        if lay is None:
            maps = self._maps or self._open()
            if self.packing == "bestfit":
                lay = bestfit_pieces(self._bestfit, self.seed if self.repack else None, epoch)
            else:
                pos, n = doc_spans([(len(mm), side["docs"]) for mm, side in maps])
                lay = shuffled_documents(pos, n, self.seq_len, self.seed, epoch)
            if len(self._layouts) >= 2:  # this epoch's and the one before (a batch may straddle them)
                self._layouts.pop(next(iter(self._layouts)))
            self._layouts[epoch] = lay
        return lay

    def identity(self) -> dict:
        """What decides this dataset's samples: its manifest (by sha256), split, repacking, and the
        length it is read at where that is not the build's."""
        return {"manifest": self.manifest_sha256[:16], "split": self.split, "repack": bool(self.repack),
                **({"seed": self.seed} if self.repack else {}),
                **({"seq_len": self.seq_len} if self.seq_len != self._built_seq_len else {})}

    def with_seq_len(self, seq_len: int) -> "MemmapChunkDataset":
        """This dataset read in chunks of another seq_len (packed data; the same files, checks and
        cache): what a Mixture stage with its own seq_len reads."""
        if seq_len == self.seq_len:
            return self
        m = self.manifest
        L, n = read_seq_len(m, split_entry(m, self.split, self.path), seq_len, self.path)
        other = object.__new__(type(self))
        other.__dict__.update(self.__getstate__())
        other.seq_len, other._len = L, n
        return other

    def __len__(self) -> int:
        return self._len

    def _keys(self, indices) -> tuple[int, list[int] | np.ndarray]:
        """(epoch, indices) of a batch's keys: ints (the current epoch) or (epoch, i) pairs."""
        if len(indices) and type(indices[0]) is tuple:
            epochs = {e for e, _ in indices}
            if len(epochs) != 1:
                raise DatasetError(f"one batch holds indices of epochs {sorted(epochs)}; give a batch of one epoch")
            return epochs.pop(), self._index([i for _, i in indices])
        return self.epoch, self._index(indices)

    def _index(self, indices) -> list[int] | np.ndarray:
        """Indices with negatives counted from the end; IndexError names the first index out of
        range.  A DataLoader batch, a short list of ints, stays a list: numpy's conversion and
        reductions cost more than the rest of a batch's bookkeeping."""
        if type(indices) is list and len(indices) <= 64 and all(type(i) is int for i in indices):
            if not indices:
                return np.empty(0, np.int64)
            idx = indices if min(indices) >= 0 else [i + self._len if i < 0 else i for i in indices]
            if min(idx) >= 0 and max(idx) < self._len:
                return idx
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not len(idx):
            return idx
        idx = np.where(idx < 0, idx + self._len, idx)
        if int(idx.min()) < 0 or int(idx.max()) >= self._len:
            bad = int(idx[(idx < 0) | (idx >= self._len)][0])
            raise IndexError(f"index {bad - self._len if bad < 0 else bad} out of range for {self._len} chunks")
        return idx

    def _shard_of(self, g: int) -> int:
        """The shard holding stream position g."""
        return bisect.bisect_right(self._starts_list, g) - 1

    def _arrays(self, what: str) -> list[np.ndarray]:
        """Per shard, its ids ("bin") or its chat mask ("mask"), mapped."""
        maps = self._maps or self._open()
        return [m[0] for m in maps] if what == "bin" else [m[1][what] for m in maps]

    def _copy(self, g: int, n: int, row: np.ndarray, arrays: list | None = None) -> None:
        """row[:n] = stream tokens [g, g + n) (or their mask), across shards where they span them."""
        arrays = arrays if arrays is not None else self._arrays("bin")
        st = self._starts_list
        k = bisect.bisect_right(st, g) - 1
        at = 0
        while at < n:  # a shard may hold fewer tokens than the piece
            take = min(n - at, st[k + 1] - g)
            row[at: at + take] = arrays[k][g - st[k]: g - st[k] + take]
            at, g, k = at + take, g + take, k + 1

    def _rows(self, idx, out: np.ndarray, lay: Pieces | None, what: str = "bin") -> None:
        """out[j] = chunk idx[j] (its ids, or with what="mask" its chat mask): one copy when it lies
        in one shard (always, but for packed chunks that span shards); gathered from its pieces
        where a layout places it (then padded: pad_id, or mask 0)."""
        arrays = self._arrays(what)
        L, st = self.seq_len, self._starts_list
        fill = self.pad_id if what == "bin" else 0
        if lay is not None:
            for j, i in enumerate(idx if type(idx) is list else idx.tolist()):
                row, at = out[j], 0
                for g, n in zip(*lay.pieces(i)):
                    self._copy(g, n, row[at: at + n], arrays)
                    at += n
                row[at:] = fill
            return
        for j, i in enumerate(idx if type(idx) is list else idx.tolist()):
            g = i * L
            k = bisect.bisect_right(st, g) - 1
            off = g - st[k]
            if off + L <= st[k + 1] - st[k]:
                out[j] = arrays[k][off: off + L]
            else:
                self._copy(g, L, out[j], arrays)

    def _valid(self, idx, lay: Pieces | None) -> np.ndarray:
        """Real tokens at the start of each chunk of idx (padded packings)."""
        if lay is not None:
            return lay.filled[np.asarray(idx, dtype=np.int64)]
        maps = self._maps or self._open()
        L, st = self.seq_len, self._starts_list
        out = np.empty(len(idx), dtype=np.int64)
        for j, i in enumerate(idx if type(idx) is list else idx.tolist()):
            k = bisect.bisect_right(st, i * L) - 1
            out[j] = maps[k][1]["valid"][i - st[k] // L]
        return out

    def _next_tokens(self, idx, lay: Pieces | None, what: str = "bin") -> np.ndarray:
        """The first token (or its chat mask) of the chunk after each of idx; -100 (mask 0) after the last chunk."""
        arrays = self._arrays(what)
        out = np.empty(len(idx), dtype=np.int64)
        for j, i in enumerate(np.asarray(idx).tolist()):
            if i + 1 >= self._len:
                out[j] = IGNORE_INDEX if what == "bin" else 0
                continue
            g = (i + 1) * self.seq_len if lay is None else int(lay.pos[lay.first[i + 1]])
            k = self._shard_of(g)
            out[j] = arrays[k][g - self._starts_list[k]]
        return out

    def document_starts(self, i, epoch: int | None = None) -> np.ndarray:
        """Offsets inside chunk i where a document begins (packed and bestfit data; needs
        position_ids=True); bestfit pieces of one long document each begin one.  `epoch`: of a
        dataset that repacks (default: the current one; `i` may also be an (epoch, i) pair)."""
        if not self.position_ids:
            raise DatasetError("document_starts needs MemmapChunkDataset(..., position_ids=True)")
        if type(i) is tuple:
            epoch, i = i
        i = int(self._index([int(i)])[0])
        lay = self._layout(self.epoch if epoch is None else epoch)
        if lay is not None:
            return lay.document_starts(i)
        maps = self._maps or self._open()
        L, st = self.seq_len, self._starts_list
        lo, out = i * L, []
        k = self._shard_of(lo)
        while k < len(st) - 1 and st[k] < lo + L:
            offs = maps[k][1]["docs"]
            a, b = np.searchsorted(offs, [lo - st[k], lo + L - st[k]])
            out.append(offs[a:b] + (st[k] - lo))
            k += 1
        return np.concatenate(out) if len(out) != 1 else out[0]

    def _batch(self, epoch: int, idx) -> dict:
        L = self.seq_len
        lay = self._layout(epoch)
        # One allocation for all fields: a DataLoader worker moves each storage it returns into
        # shared memory, one segment per storage (measured: 1.7 ms a batch for three, 0.8 for one).
        buf = np.empty((len(self.fields), len(idx), L), dtype=np.int64)
        # labels are their own rows: editing them leaves input_ids alone
        ids, labels, mask = (None if k is None else buf[k] for k in self._slots)
        self._rows(idx, ids, lay)
        pad = valid = None
        if self._padded:
            valid = self._valid(idx, lay)
            pad = np.arange(L)[None, :] >= valid[:, None]
        if labels is not None:
            if self.shifted:
                labels[:, :-1] = ids[:, 1:]
                labels[:, -1] = self._next_tokens(idx, lay)
            else:
                labels[:] = ids
                if pad is not None:
                    labels[pad] = IGNORE_INDEX
            if self.chat:  # only the tokens the build's --loss chose train (padding never does)
                trains = np.empty((len(idx), L), dtype=MASK_DTYPE)
                self._rows(idx, trains, lay, "mask")
                if self.shifted:  # label t is token t + 1: its mask decides
                    trains[:, :-1] = trains[:, 1:]
                    trains[:, -1] = self._next_tokens(idx, lay, "mask")
                labels[trains == 0] = IGNORE_INDEX
        if mask is not None:
            if pad is None:
                mask.fill(1)
            else:
                np.logical_not(pad, out=mask, casting="unsafe")
        b = dict(zip(self.fields, torch.from_numpy(buf).unbind(0)))
        if self.position_ids:
            from .masking import boundaries

            starts = [self.document_starts(i, epoch) for i in np.asarray(idx).tolist()]
            if valid is not None:  # bestfit: a chunk's padding is a segment of its own
                starts = [np.append(st, v) if v < L else st for st, v in zip(starts, valid.tolist())]
            bd = boundaries(starts, L)
            b["position_ids"] = bd["position_ids"]
            if self.document_masking:
                b.update(document_ids=bd["document_ids"], cu_seqlens=bd["cu_seqlens"], max_seqlen=bd["max_seqlen"])
        return b

    def __getitem__(self, i) -> dict:
        b = self._batch(*self._keys([i if type(i) is tuple else int(i)]))
        return {k: v[0] for k, v in b.items() if k not in BATCH_KEYS}

    collate = staticmethod(collate)

    def __getitems__(self, indices) -> ChunkBatch:
        # DataLoader calls this with a whole batch of indices: one fancy index per shard.
        epoch, idx = self._keys(indices)
        return ChunkBatch(self._batch(epoch, idx), len(idx))

    def __repr__(self) -> str:
        return (f"MemmapChunkDataset({self.path!r}, split={self.split!r}, chunks={self._len}, "
                f"seq_len={self.seq_len}, dtype={self.dtype.name}, packing={self.packing})")
