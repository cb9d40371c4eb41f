"""A split's manifest entry from the units' (or parts') shard lists and counts: metadata only, no token read."""

from __future__ import annotations

COUNTED = ("documents", "tokens", "text_bytes", "pad_tokens", "dropped_tokens", "dropped_documents")


def join_split(pieces: list[dict], shards: list[dict], seq_len: int, packing: str) -> dict:
    """The entry of a split made of `pieces` (each with the COUNTED keys: one unit's counts, or a
    part's split entry), whose shards in order are `shards`.

    packed: the shards concatenated are the split's stream; its chunks are cut over all of it,
    so only the stream's last partial chunk is dropped, however the units were partitioned.
    document, bestfit: every shard holds whole chunks; the pieces' counts add up.
    """
    d = {k: sum(p[k] for p in pieces) for k in COUNTED}
    stored = sum(e["num_tokens"] for e in shards)
    chunks = stored // seq_len
    if packing == "packed":
        d["pad_tokens"] = d["dropped_documents"] = 0
        d["dropped_tokens"] = stored - chunks * seq_len
    return {"num_chunks": chunks, "num_tokens": chunks * seq_len, **d, "shards": shards}


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
    for side in ("docs", "valid"):
        if side in e:
            e[side] = {k: v for k, v in e[side].items() if k != "state"}
    return e
