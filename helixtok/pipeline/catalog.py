"""The manifest from the units' (or parts') journal entries, shard lists and counts: metadata only, no token read."""

from __future__ import annotations

from ..format.bestfit import build_index, doc_spans, write_index
from ..format.manifest import DOC_SKIPS, FORMAT_VERSION, REPAIRS, SIDE_NAMES, sum_sources
from ..version import __version__

CHAT_TEMPLATE = "chat_template.jinja"  # a chat build's template, beside its tokenizer.json
COUNTED = ("documents", "tokens", "text_bytes", "pad_tokens", "dropped_tokens", "dropped_documents")



class Built(dict):
    """What build() returns: the manifest, and how the run went (not part of the dataset)."""

    reused_units = 0  # work units an interrupted run had finished, taken as they were
    units = 0
    notes: list[str] = []  # what the user should know of the run (one line each, on stderr)
    processes: tuple[int, str] | None = None  # how many processes tokenized, and why that many
    copied = 0  # units of this run whose ids were written to a file of their own, then copied into place


class UpToDate(Built):
    """The manifest build() returns when OUT already held this very build: nothing was written."""


def join_split(pieces: list[dict], shards: list[dict], seq_len: int, packing: str, index=None) -> dict:
    """The entry of a split made of `pieces` (each with the COUNTED keys: one unit's counts, or a
    part's split entry), whose shards in order are `shards`.

    packed: the shards concatenated are the split's stream; its chunks are cut over all of it,
    so only the stream's last partial chunk is dropped, however the units were partitioned.
    bestfit: `index` (bestfit.Index, with its files' entry as `index.entry`) places the chunks
    over the whole stream and says what was padded and dropped.
    document: every shard holds whole chunks; the pieces' counts add up.
    """
    d = {k: sum(p[k] for p in pieces) for k in COUNTED}
    stored = sum(e["num_tokens"] for e in shards)
    chunks = stored // seq_len
    if packing == "packed":
        d["pad_tokens"] = d["dropped_documents"] = 0
        d["dropped_tokens"] = stored - chunks * seq_len
    extra = {}
    if packing == "bestfit":
        chunks = index.num_chunks
        d.update(pad_tokens=index.pad_tokens, dropped_tokens=index.dropped_tokens,
                 dropped_documents=index.dropped_documents)
        extra = {"index": index.entry}
    return {"num_chunks": chunks, "num_tokens": chunks * seq_len, **d, "shards": shards, **extra}


def bestfit_index(shards: list[dict], split: str, config, read_docs, folder: str):
    """The split's bestfit index, placed from its documents' lengths (read_docs(a shard's "docs"
    entry): its .docs offsets, 8 bytes a document, no token read) and written into `folder`."""
    spans = doc_spans([(e["num_tokens"], read_docs(e["docs"])) for e in shards])
    idx = build_index(*spans, config.seq_len, config.tail_len)
    idx.entry = write_index(folder, split, idx)
    return idx


def chat_counts(pieces: list[dict], split: dict, shards: list[dict], packing: str, read_mask) -> dict:
    """A chat split's counts: the pieces' (units' or parts') summed, and `dropped_trainable_tokens`,
    the 1s of its masks in what no chunk holds (packed: the stream's last partial chunk; the other
    packings store whole chunks, and a conversation too long is never stored).  read_mask(mask
    entry, start, stop): those bytes of its .mask file (at most seq_len - 1 are read in all);
    `shards`: the split's, in order, as read_mask takes them."""
    c = {k: sum(p[k] for p in pieces) for k in pieces[0] if k != "dropped_trainable_tokens"} if pieces else {}
    left, ones = split["dropped_tokens"] if packing == "packed" else 0, 0
    for e in reversed(shards):
        if left <= 0:
            break
        n = min(left, e["num_tokens"])
        ones += read_mask(e["mask"], e["num_tokens"] - n, e["num_tokens"]).count(1)
        left -= n
    c["dropped_trainable_tokens"] = ones
    return c


def split_totals(splits: dict) -> dict:
    """The manifest's totals over its splits (a caller adds what never reached a split)."""
    t = {k: sum(s[k] for s in splits.values()) for k in COUNTED}
    t["chunks"] = sum(s["num_chunks"] for s in splits.values())
    t["stored_tokens"] = sum(s["num_tokens"] for s in splits.values())
    return t


def unit_counts(result: dict, split: str) -> dict:
    """One unit's journal entry as a piece of join_split."""
    c = result["counts"][split]
    return {"documents": result["documents"][split], "tokens": result["tokens"][split],
            "text_bytes": result["text_bytes"][split], "pad_tokens": c["pad_tokens"],
            "dropped_tokens": c["dropped_tokens"], "dropped_documents": c["dropped_documents"]}


def published(e: dict) -> dict:
    """A journal entry's shard as the manifest lists it (without its name in the build's state folder)."""
    e = {k: v for k, v in e.items() if k != "state"}
    for side in SIDE_NAMES:
        if side in e:
            e[side] = {k: v for k, v in e[side].items() if k != "state"}
    return e


def build_manifest(config, info, backend_check: dict, files, units, part: dict | None, splits: dict,
                   results: list[dict], tally, warnings, fields: dict | None = None) -> dict:
    """A build's manifest.json: its options, tokenizer, inputs, splits and every count, from the
    units' journal entries `results` (in unit order) and what was skipped (`tally`, `warnings`)."""
    totals = split_totals(splits)
    totals["skipped_documents"] = sum(n for r, n in tally.counts.items() if r in DOC_SKIPS or r.startswith("map:"))
    totals["repaired_documents"] = sum(tally.counts.get(r, 0) for r in REPAIRS)
    return {
        "format_version": FORMAT_VERSION,
        "helixtok_version": __version__,
        "dtype": "uint16" if info.dtype.itemsize == 2 else "uint32",
        "seq_len": config.seq_len,
        "packing": config.packing,
        "min_tail_len": config.tail_len if config.packing != "packed" else None,
        "tokenizer": {**info.to_json(), "file": "tokenizer.json", "backend_check": backend_check},
        "options": {"text_field": config.text_field, "val_fraction": config.val_fraction,
                    **({"val_size": config.val_size} if config.val_size else {}),
                    **({"map": config.transform, "map_sha256": config.transform_sha256} if config.transform else {}),
                    "split_seed": config.split_seed, "shard_bytes": config.shard_bytes,
                    "unit_bytes": config.unit_bytes, "max_piece_chars": config.max_piece_chars,
                    "strip": config.strip},
        "inputs": {"files": len(files), "bytes": sum(f.size for f in files), "units": len(units),
                   "list": [{"name": f.name, "bytes": f.size} for f in files]},
        **({"partition": part} if part else {}),
        "splits": splits,
        "totals": totals,
        "sources": sum_sources(r["sources"] for r in results),
        # Documents per work unit and split, in unit order: where a document came from (inspect/show.py).
        "unit_documents": {sp: [r["documents"].get(sp, 0) for r in results] for sp in splits},
        # And what each unit read, for its documents' .src entries (format/manifest.py: document_source).
        **({"unit_sources": [unit_source(u, r) for u, r in zip(units, results)]} if config.packing != "document"
           else {}),
        # The records' --keep-fields, a line per unit in fields.jsonl (format/fields.py).
        **({"fields": fields} if fields else {}),
        "skipped": tally.to_json(),
        "warnings": warnings.to_json(),
        **({"chat": {**config.chat.to_json(), "template_file": CHAT_TEMPLATE}} if config.chat else {}),
    }


def unit_source(u, r: dict) -> list:
    """What work unit `u` (its journal entry `r`) read, as a .src entry is resolved against it: ["file",
    [its files]], ["element", file], ["row", file, first row], or ["line", file, its first line (0: the
    lines of the units before it in the file tell), its lines]."""
    if u.kind == "text":
        return ["file", list(u.names)]
    if u.array:
        return ["element", u.names[0]]
    if u.kind in ("parquet", "arrow"):
        return ["row", u.names[0], u.first_line]
    return ["line", u.names[0], u.first_line, r.get("lines", 0)]
