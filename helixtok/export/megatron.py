"""Megatron-LM indexed datasets (.bin/.idx, "MMIDIDX"): export a packed build as one, import one as a build."""

from __future__ import annotations

import contextlib
import os
import shutil
import struct

import numpy as np

from ..format.errors import ConfigError, DatasetError, InputError
from ..format.manifest import MANIFEST, load_manifest, split_entry
from ..pipeline.outdir import (STATE, OutLock, check_out_path, publish, refuse_foreign, refuse_foreign_state,
                               remove_owned)
from ..read.splitview import SplitView

HEADER = b"MMIDIDX\x00\x00"
VERSION = 1
# megatron.core.datasets.indexed_dataset.DType codes
CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}
SLICE = 1 << 22  # tokens converted per step when the dtype changes


def megatron_dtype(vocab_size: int) -> type:
    """Megatron's rule (DType.optimal_dtype): uint16 below 65,500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def write_index(path: str, dtype: type, lengths: np.ndarray) -> None:
    """The .idx file: header, version, dtype code, counts, int32 lengths, int64 byte pointers,
    int64 document indices (one document per sequence)."""
    code = next(c for c, t in CODES.items() if t == dtype)
    pointers = np.concatenate(([0], np.cumsum(lengths[:-1], dtype=np.int64))) * np.dtype(dtype).itemsize
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(HEADER + struct.pack("<Q", VERSION) + struct.pack("<B", code))
        fh.write(struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(lengths) + 1))
        fh.write(lengths.astype("<i4").tobytes())
        fh.write(pointers.astype("<i8").tobytes())
        fh.write(np.arange(len(lengths) + 1, dtype="<i8").tobytes())
    os.replace(tmp, path)


def export_megatron(src: str, prefix: str, *, split: str = "train") -> dict:
    """Write PREFIX.bin / PREFIX.idx, which megatron-core's IndexedDataset(PREFIX) reads unchanged:
    one sequence per document (its ids and EOS, as preprocess_data.py --append-eod makes them).

    packed: every document of the stream on disk, whole (the stream's last partial chunk too).
    .bin is the build's shard, hard-linked, when there is one shard of Megatron's dtype; else the
    shards are concatenated (converted to int32 for vocabularies >= 65,500).
    bestfit: one sequence per item of the chunks, padding left out: a document of at most seq_len
    tokens whole, a longer one as its seq_len pieces (bestfit stores them apart)."""
    m = load_manifest(src)
    s = split_entry(m, split, src)
    if m["packing"] == "document":
        raise ConfigError(f"{src}: a document-packed build holds chunks, not documents (their short ones and tails "
                          "were dropped); export a packed or bestfit build")
    dtype = megatron_dtype(int(m["tokenizer"]["vocab_size"]))
    ours = np.dtype("<u2" if m["dtype"] == "uint16" else "<u4")
    view = SplitView(src, m, split)
    for p in (prefix + ".bin", prefix + ".idx"):
        if os.path.exists(p):
            raise ConfigError(f"{p}: exists; give a new prefix")
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    tmp = prefix + ".bin.tmp"
    how = "copied"
    try:
        if m["packing"] == "bestfit":
            lengths = _write_items(view, tmp, dtype)
        else:
            lengths = view.document_lengths()
            shards = [os.path.join(src, e["path"]) for e in s["shards"]]
            if len(shards) == 1 and np.dtype(dtype) == ours:
                size = os.path.getsize(shards[0])  # linked as it is: its size is checked here
                if size != s["shards"][0]["bytes"]:
                    raise DatasetError(f"{shards[0]}: {size} bytes, its manifest says {s['shards'][0]['bytes']} "
                                       "(damaged or changed since the build); copy the dataset again or rebuild it")
                try:
                    os.link(shards[0], tmp)
                    how = "linked"
                except OSError:
                    shutil.copyfile(shards[0], tmp)
            else:
                with open(tmp, "wb") as out:
                    for ids in view.iter_stream(SLICE):
                        out.write(ids.astype(dtype, copy=False).tobytes())
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    os.replace(tmp, prefix + ".bin")
    write_index(prefix + ".idx", dtype, lengths)  # last: a prefix with an .idx is complete
    return {"documents": len(lengths), "tokens": int(lengths.sum()), "dtype": np.dtype(dtype).name, "bin": how}


def _write_items(view: SplitView, path: str, dtype) -> np.ndarray:
    """A bestfit split's items in chunk order (each a document, or a seq_len piece of a longer
    one), written back to back without padding; returns their lengths."""
    lay = view.pieces()
    with open(path, "wb") as out:
        for g, n in zip(lay.pos.tolist(), lay.size.tolist()):
            out.write(view.tokens(g, g + n).astype(dtype).tobytes())
    return lay.size.copy()


def read_index(prefix: str) -> tuple[type, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, sequence lengths, byte pointers, document indices) of PREFIX.idx, validated."""
    path = prefix + ".idx"
    try:
        with open(path, "rb") as fh:
            head = fh.read(34)
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror}); give the prefix without .bin/.idx") from None
    if len(head) < 34 or head[:9] != HEADER or struct.unpack("<Q", head[9:17])[0] != VERSION:
        raise InputError(f"{path}: not a Megatron indexed dataset index (MMIDIDX version 1)")
    code = head[17]
    if code not in CODES:
        raise InputError(f"{path}: unknown dtype code {code}")
    n, d = struct.unpack("<QQ", head[18:34])
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    if len(raw) != 34 + n * 4 + n * 8 + d * 8:
        raise InputError(f"{path}: {len(raw)} bytes, but its counts ({n} sequences, {d} document indices) "
                         f"need {34 + n * 12 + d * 8}; the index is truncated or corrupt")
    lengths = np.frombuffer(raw, dtype="<i4", count=n, offset=34).astype(np.int64)
    pointers = np.frombuffer(raw, dtype="<i8", count=n, offset=34 + 4 * n)
    docs = np.frombuffer(raw, dtype="<i8", count=d, offset=34 + 12 * n)
    return CODES[code], lengths, pointers, docs


def import_megatron(prefix: str, out: str, tokenizer: str, *, seq_len: int, shard_bytes: int) -> dict:
    """Write a helixtok packed dataset in `out` from PREFIX.bin/.idx: the documents' stream
    (sequences grouped by Megatron's document indices) cut into seq_len chunks, with .docs
    sidecars, so stats, ChunkSampler and MemmapChunkDataset work on it.  Ids are checked
    against the tokenizer's vocabulary; the manifest is written last."""
    from ..pipeline.tokenizer import inspect_tokenizer, release_bytes, tokenizer_bytes

    info = inspect_tokenizer(tokenizer)
    data = tokenizer_bytes(info.sha256)  # OUT's copy is the file as read for the checks below
    release_bytes(info.sha256)
    mdtype, lengths, pointers, docs = read_index(prefix)
    item = np.dtype(mdtype).itemsize
    binp = prefix + ".bin"
    total = int(lengths.sum())
    size = os.path.getsize(binp) if os.path.isfile(binp) else -1
    if size != total * item:
        raise InputError(f"{binp}: {size} bytes, its index says {total} tokens x {item} bytes; copy it again")
    if len(lengths) and (pointers != np.concatenate(([0], np.cumsum(lengths[:-1]))) * item).any():
        raise InputError(f"{prefix}.idx: sequences are not stored back to back; not a dataset helixtok can import")
    if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(lengths) or (np.diff(docs) < 0).any():
        raise InputError(f"{prefix}.idx: document indices do not cover the sequences in order")
    if total < seq_len:
        raise ConfigError(f"{prefix}: {total} tokens, not one chunk of --seq-len {seq_len}")
    check_out_path(out)
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    try:
        with OutLock(out):
            if os.path.isfile(os.path.join(out, MANIFEST)):
                raise ConfigError(f"{out}: already holds a dataset; give a new path")
            # Written in STATE and published as a build is: an import killed halfway leaves only
            # STATE, which the same command removes and starts again.
            refuse_foreign_state(out)
            refuse_foreign(out)
            remove_owned(out)
            return _import_locked(prefix, out, info, data, mdtype, lengths, docs, seq_len, shard_bytes)
    except BaseException:
        if created:  # it was not there before: leave nothing behind
            with contextlib.suppress(OSError):
                os.rmdir(out)
        raise


def _import_locked(prefix, out, info, data, mdtype, lengths, docs, seq_len, shard_bytes) -> dict:
    from ..format.manifest import FORMAT_VERSION
    from ..format.shards import ShardFiles
    from ..pipeline.catalog import join_split, published
    from ..version import __version__

    binp = prefix + ".bin"
    total = int(lengths.sum())
    size = os.path.getsize(binp)
    state = os.path.join(out, STATE)
    os.makedirs(state)
    seq_starts = np.concatenate(([0], np.cumsum(lengths)))
    doc_starts = seq_starts[docs[:-1]]
    doc_starts = doc_starts[np.concatenate(([True], np.diff(doc_starts) > 0))]  # empty documents: no start
    L = seq_len
    cap = max(1, shard_bytes // (L * info.dtype.itemsize)) * L
    writer = ShardFiles(os.path.join(state, "g000000.train"), "train-000000", info.dtype, L, cap, ("docs",))
    try:
        ids_all = np.memmap(binp, dtype=np.dtype(mdtype).newbyteorder("<"), mode="r") if total else np.empty(0)
        for a in range(0, total, SLICE):
            ids = np.asarray(ids_all[a: a + SLICE])
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= info.vocab_size):
                bad = int(ids[(ids < 0) | (ids >= info.vocab_size)][0])
                raise InputError(f"{binp}: token id {bad} is outside the vocabulary of {info.path} "
                                 f"({info.vocab_size} ids); give the tokenizer this dataset was made with")
            lo, hi = np.searchsorted(doc_starts, [a, a + len(ids)])
            writer.write(ids.astype(info.dtype), starts=doc_starts[lo:hi] - a)
        del ids_all
        shards = writer.close()
    except BaseException:
        writer.abort()
        shutil.rmtree(state, ignore_errors=True)
        raise
    # Published under the names a build gives its shards.
    moves = [(os.path.basename(x["state"]), x["path"]) for e in shards for x in (e, e["docs"])]
    # One writer: each shard is one segment (docs/format.md, version 4).
    shards = [{**published(e), "segments": [[e["bytes"], e["sha256"]]]} for e in shards]
    for e in shards:
        del e["sha256"]
    with open(os.path.join(state, "tokenizer.json"), "wb") as fh:
        fh.write(data)
    moves.append(("tokenizer.json", "tokenizer.json"))
    split = join_split([{"documents": len(doc_starts), "tokens": total, "text_bytes": 0, "pad_tokens": 0,
                         "dropped_tokens": 0, "dropped_documents": 0}], shards, L, "packed")
    n = split["num_chunks"]
    manifest = {
        "format_version": FORMAT_VERSION, "helixtok_version": __version__,
        "dtype": "uint16" if info.dtype.itemsize == 2 else "uint32", "seq_len": L, "packing": "packed",
        "min_tail_len": None,
        "tokenizer": {**info.to_json(), "backend": "megatron-import", "backend_version": None,
                      "file": "tokenizer.json"},
        "options": {"shard_bytes": shard_bytes},
        # The prefix's own name, never the host path (docs/format.md: no absolute host paths).
        "inputs": {"megatron_prefix": os.path.basename(prefix), "bytes": size, "files": 2, "units": 0,
                   "list": [{"name": os.path.basename(prefix) + ext, "bytes": os.path.getsize(prefix + ext)}
                            for ext in (".bin", ".idx")]},
        "splits": {"train": split},
        "totals": {"documents": len(doc_starts), "tokens": total, "pad_tokens": 0,
                   "dropped_tokens": split["dropped_tokens"], "dropped_documents": 0, "chunks": n, "stored_tokens": n * L},
        "skipped": {}, "warnings": {},
    }
    publish(out, moves, manifest)
    return manifest
