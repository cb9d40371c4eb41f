"""Write a packed uint16 build as HelixLM's pretraining store (helix.pretrain.samples.v1), shards linked, not copied."""

from __future__ import annotations

import os
import shutil

from . import __version__
from .errors import ConfigError
from .manifest import load_manifest, split_entry, write_json_atomic

FORMAT = "helix.pretrain.samples.v1"
MANIFEST = "manifest.json"

# The store's manifest fields, as HelixLM's compiler writes them (and its reader expects).
FIELDS = ("format_version", "token_dtype", "seq_len", "eos_token_id", "source_rows", "raw_utf8_bytes",
          "encoded_tokens", "sample_count", "causal_target_count", "dropped_tail_tokens", "samples_per_shard",
          "source", "shards")
SHARD_FIELDS = ("file", "start_sample", "sample_count", "bytes", "sha256")


def _place(src: str, dst: str) -> str:
    """Hard-link src to dst (the same bytes, no copy); copy across file systems. Returns which."""
    tmp = dst + ".tmp"
    if os.path.lexists(tmp):
        os.remove(tmp)
    try:
        os.link(src, tmp)
        how = "linked"
    except OSError:
        shutil.copyfile(src, tmp)
        how = "copied"
    os.replace(tmp, dst)
    return how


def export_helixlm(src: str, dest: str, *, split: str = "train") -> dict:
    """Write `dest` as a HelixLM store of `src`'s split; returns its manifest (written last).

    The token stream is helixtok's: each document's ids then one EOS, packed into seq_len
    samples, the final partial sample dropped. HelixLM's compiler also strips each text first:
    build with `--strip` for the identical stream (the manifest's source records which).
    """
    m = load_manifest(src)
    s = split_entry(m, split, src)
    if m["packing"] != "packed":
        raise ConfigError(f"{src}: HelixLM's store is a packed stream; this build is {m['packing']}-packed "
                          "(rebuild with --pack packed)")
    if m["dtype"] != "uint16" or m["tokenizer"].get("add_bos"):
        raise ConfigError(f"{src}: HelixLM's store holds uint16 ids with no BOS; this build is {m['dtype']}"
                          f"{' with --bos' if m['tokenizer'].get('add_bos') else ''}")
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise ConfigError(f"{dest}: exists and is not an empty folder; give a new path")
    os.makedirs(dest, exist_ok=True)
    L = int(m["seq_len"])
    shards, start, placed = [], 0, set()
    for i, e in enumerate(s["shards"]):
        name = f"samples-{i:05d}.u16"
        placed.add(_place(os.path.join(src, e["path"]), os.path.join(dest, name)))
        n = int(e["num_chunks"])
        shards.append({"file": name, "start_sample": start, "sample_count": n, "bytes": int(e["bytes"]),
                       "sha256": e["sha256"]})
        start += n
    store = {
        "format_version": FORMAT,
        "token_dtype": "<u2",
        "seq_len": L,
        "eos_token_id": int(m["tokenizer"]["eos_id"]),
        "source_rows": int(s["documents"]),
        "raw_utf8_bytes": int(s["text_bytes"]),
        "encoded_tokens": int(s["tokens"]),
        "sample_count": int(s["num_chunks"]),
        "causal_target_count": int(s["num_chunks"]) * (L - 1),  # next-token targets inside the samples
        "dropped_tail_tokens": int(s["dropped_tokens"]),
        "samples_per_shard": int(s["shards"][0]["num_chunks"]) if s["shards"] else 0,
        # Relative to the store: no host path in a file that travels (docs/format.md).
        "source": {"tool": f"helixtok {__version__}", "dataset": os.path.relpath(os.path.abspath(src), os.path.abspath(dest)),
                   "split": split,
                   "tokenizer_sha256": m["tokenizer"]["sha256"], "stripped": bool(m["options"].get("strip")),
                   "shards": "+".join(sorted(placed)) or "none"},
        "shards": shards,
    }
    write_json_atomic(os.path.join(dest, MANIFEST), store)
    return store
