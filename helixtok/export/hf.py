"""A build's documents as a Hugging Face datasets.Dataset (one row each, memory-mapped Arrow written once): what TRL's SFTTrainer takes."""

from __future__ import annotations

import hashlib
import os

import numpy as np

from ..format.errors import ConfigError, DatasetError
from ..format.manifest import MANIFEST, load_manifest
from ..format.objstore import is_url
from ..pipeline.config import cache_root
from ..read.splitview import SplitView

ROWS_TOKENS = 1 << 23  # tokens per Arrow record batch written: memory stays flat over any split


def to_hf(out: str, split: str = "train", *, cache_dir: str | None = None):
    """Split `split` of the dataset in `out` as a `datasets.Dataset`, one row per document (a chat
    build's: per conversation, or per --chat-split turns sample) in stream order: `input_ids`, and
    for a chat build `assistant_masks` (1 where its mask trains: the column TRL's SFTTrainer turns
    into labels, whatever its completion_only_loss) -- so SFTTrainer(train_dataset=to_hf(OUT))
    tokenizes nothing and may pack it (packing=True).  Written once as an Arrow file under
    `cache_dir` (default $HELIXTOK_CACHE/hf), named for the manifest's sha256: the same dataset is
    not written again; a rebuilt one gets its own file.  Packed and bestfit builds, local."""
    try:
        import datasets
    except ImportError:
        raise ConfigError("to_hf needs Hugging Face datasets: pip install datasets") from None
    if is_url(out):
        raise ConfigError(f"{out}: to_hf reads a local dataset; helixtok pull it first")
    m = load_manifest(out)
    if m["packing"] == "document":
        raise DatasetError(f"{out}: packed with --pack document, whose chunks keep no boundary between documents; "
                           "helixtok repack it packed or bestfit first")
    with open(os.path.join(out, MANIFEST), "rb") as fh:
        sha = hashlib.sha256(fh.read()).hexdigest()
    folder = cache_dir or os.path.join(cache_root(), "hf")
    path = os.path.join(folder, f"{sha[:16]}-{split}.arrow")
    if not os.path.isfile(path):
        os.makedirs(folder, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            _write(SplitView(out, m, split), bool(m.get("chat")), tmp)
            os.replace(tmp, path)  # whole or not at all: a reader never maps a half-written file
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
    return datasets.Dataset.from_file(path)


def _write(view: SplitView, chat: bool, path: str) -> None:
    """The split's documents as an Arrow stream file: list columns made from the ids' and mask's
    own arrays and the documents' offsets (no row built in Python)."""
    import pyarrow as pa

    end = int(view.starts[-1])
    bounds = np.append(view.starts_in(0, end), end).astype(np.int64)
    fields = [("input_ids", pa.list_(pa.int32()))] + ([("assistant_masks", pa.list_(pa.int8()))] if chat else [])
    schema = pa.schema(fields)
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_stream(sink, schema) as w:
        i = 0
        while i < len(bounds) - 1:
            j = max(i + 1, int(np.searchsorted(bounds, bounds[i] + ROWS_TOKENS, "right")) - 1)
            a, b = int(bounds[i]), int(bounds[j])
            offsets = pa.array((bounds[i: j + 1] - a).astype(np.int32))
            cols = [pa.ListArray.from_arrays(offsets, pa.array(view.tokens(a, b).astype(np.int32)))]
            if chat:
                cols.append(pa.ListArray.from_arrays(offsets, pa.array(view.tokens(a, b, "mask").astype(np.int8))))
            w.write_batch(pa.record_batch(cols, schema=schema))
            i = j
