"""Write a packed uint16 build as HelixLM's pretraining store (helix.pretrain.samples.v1): its chunks, in shards of whole samples."""

from __future__ import annotations

import os

from ..format.errors import ConfigError
from ..format.manifest import load_manifest, split_entry, write_json_atomic
from ..format.shards import HashedFile
from ..read.splitview import SplitView
from ..version import __version__

FORMAT = "helix.pretrain.samples.v1"
MANIFEST = "manifest.json"

# The store's manifest fields, as HelixLM's compiler writes them (and its reader expects).
FIELDS = ("format_version", "token_dtype", "seq_len", "eos_token_id", "source_rows", "raw_utf8_bytes",
          "encoded_tokens", "sample_count", "causal_target_count", "dropped_tail_tokens", "samples_per_shard",
          "source", "shards")
SHARD_FIELDS = ("file", "start_sample", "sample_count", "bytes", "sha256")




def _write_samples(view: SplitView, a: int, b: int, path: str) -> dict:
    """Chunks [a, b) of `view` as one store shard (temp + fsync + rename): its bytes and sha256."""
    f = HashedFile(path)
    try:
        step = max(1, (1 << 22) // view.L)
        for c in range(a, b, step):
            f.write(view.tokens(c * view.L, min(b, c + step) * view.L))
        return f.commit()
    except BaseException:
        f.abort()
        raise


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
        bos = ""
        if m["tokenizer"].get("add_bos"):  # --bos, or the tokenizer's own rule (Llama 3's): say which, and the fix
            bos = (" with a BOS before each document (--bos)" if m["tokenizer"].get("bos_rule") == "--bos" else
                   " with a BOS before each document (the tokenizer's own rule: rebuild with --no-bos)")
        raise ConfigError(f"{src}: HelixLM's store holds uint16 ids with no BOS; this build is {m['dtype']}{bos}")
    if os.path.exists(dest) and (not os.path.isdir(dest) or os.listdir(dest)):
        raise ConfigError(f"{dest}: exists and is not an empty folder; give a new path")
    os.makedirs(dest, exist_ok=True)
    L = int(m["seq_len"])
    view = SplitView(src, m, split)
    per = max(1, int(m["options"].get("shard_bytes", 1 << 30)) // (L * 2))  # samples a store shard holds
    shards = []
    for k, start in enumerate(range(0, view.num_chunks, per)):
        n = min(per, view.num_chunks - start)
        name = f"samples-{k:05d}.u16"
        e = _write_samples(view, start, start + n, os.path.join(dest, name))
        shards.append({"file": name, "start_sample": start, "sample_count": n, "bytes": e["bytes"],
                       "sha256": e["sha256"]})
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
        "samples_per_shard": shards[0]["sample_count"] if shards else 0,
        # Relative to the store: no host path in a file that travels (docs/format.md).
        "source": {"tool": f"helixtok {__version__}", "dataset": os.path.relpath(os.path.abspath(src), os.path.abspath(dest)),
                   "split": split,
                   "tokenizer_sha256": m["tokenizer"]["sha256"], "stripped": bool(m["options"].get("strip"))},
        "shards": shards,
    }
    write_json_atomic(os.path.join(dest, MANIFEST), store)
    return store
