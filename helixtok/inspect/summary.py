"""A built dataset in numbers a person reads: shares, size on disk, sources, and warnings naming the option to change."""

from __future__ import annotations

import os

from ..format.manifest import manifest_files
from ..format.objstore import is_url

DROP_WARN = 0.05  # more documents or tokens dropped than this: say so, and what keeps them
PAD_WARN = 0.10  # more of the stored tokens padding than this: say so, and what avoids it


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def bytes_on_disk(m: dict, folder: str) -> int | None:
    """What the dataset's files take (shards, sidecars, tokenizer), or None where they cannot be seen."""
    if is_url(folder):
        return None
    try:
        return sum(os.path.getsize(os.path.join(folder, p)) for p in manifest_files(m))
    except OSError:
        return None


def alerts(m: dict) -> list[str]:
    """One line per thing a user should know before training on this dataset, with the fix."""
    t, out = m["totals"], []
    docs, toks = _share(t["dropped_documents"], t["documents"]), _share(t["dropped_tokens"], t["tokens"])
    chat = bool(m.get("chat"))  # a chat build keeps whole conversations: no tail or packing advice fits it
    if (docs > DROP_WARN or toks > DROP_WARN) and not chat:
        if m["packing"] != "packed":
            out.append(f"{docs:.1%} of documents ({t['dropped_documents']:,}) and {toks:.1%} of tokens were dropped: "
                       f"{m['packing']} packing drops documents and tails shorter than --min-tail-len "
                       f"({m['min_tail_len']}); --min-tail-len {int(m['packing'] == 'document')} keeps them"
                       + (", --pack bestfit keeps every document whole and drops nothing" if m["packing"] == "document"
                          else "") + ", --pack packed drops only the last partial chunk")
        else:
            out.append(f"{toks:.1%} of tokens were dropped (the last partial chunk of --seq-len {m['seq_len']}): "
                       "lower --seq-len or add text")
    pad = _share(t["pad_tokens"], t["chunks"] * m["seq_len"])
    if pad > PAD_WARN and chat:
        out.append(f"{pad:.1%} of the stored tokens are padding: conversations are kept whole, so what they leave of "
                   f"each --seq-len {m['seq_len']} chunk is padded; a --seq-len nearer their lengths lowers it")
    elif pad > PAD_WARN and m["packing"] == "bestfit":
        out.append(f"{pad:.1%} of the stored tokens are padding: bestfit never cuts a document of up to --seq-len "
                   f"{m['seq_len']} tokens (longer ones are cut into --seq-len pieces), so what the documents leave "
                   "is padded; a shorter --seq-len, or more documents to combine, lowers it, --pack packed stores "
                   "none (documents then run across chunks)")
    elif pad > PAD_WARN:
        out.append(f"{pad:.1%} of the stored tokens are padding (document packing pads each document's last "
                   "chunk): --pack bestfit fills chunks with whole documents, several to a chunk (far less padding: "
                   "docs/packing.md), --pack packed stores none")
    out += _chat_alerts(m)
    if m["seq_len"] < 2:
        out.append(f"--seq-len {m['seq_len']}: each chunk is one token, with no next-token target inside it; fine "
                   "for looking at ids, not for training: build with the context length you train at")
    return out


def chat_counts(m: dict) -> dict | None:
    """A chat build's counts summed over its splits (manifest: splits.<s>.chat), else None."""
    if not m.get("chat"):
        return None
    per = [s["chat"] for s in m["splits"].values() if "chat" in s]
    return {k: sum(c[k] for c in per) for k in per[0]} if per else None


def _chat_alerts(m: dict) -> list[str]:
    c, out = chat_counts(m), []
    if c is None:
        return out
    seen = c["conversations"] + c["dropped_too_long"] + c["no_trainable"]
    if c["dropped_too_long"]:
        out.append(f"{c['dropped_too_long']:,} of {seen:,} conversations ({_share(c['dropped_too_long'], seen):.1%}) "
                   f"are longer than --seq-len {m['seq_len']} tokens and were dropped: --truncate keeps their first "
                   f"{m['seq_len']} tokens, --truncate turns their latest exchanges that fit, a larger --seq-len keeps "
                   "them whole")
    if c["no_trainable"]:
        out.append(f"{c['no_trainable']:,} conversations have no token to train on under --loss {m['chat']['loss']} "
                   "(no assistant turn the template marks, or all of it cut by --truncate) and were dropped")
    return out


def summarize(m: dict, folder: str) -> dict:
    """The summary `helixtok build` and `helixtok info` print (and give with --json)."""
    t, tok = m["totals"], m["tokenizer"]
    stored = t["chunks"] * m["seq_len"]
    return {
        "backend": tok["backend"], "backend_version": tok.get("backend_version"),
        "reference_version": tok.get("reference_version"), "add_bos": tok["add_bos"], "bos_token": tok["bos_token"],
        "bos_rule": tok.get("bos_rule"),
        "documents": t["documents"], "tokens": t["tokens"], "chunks": t["chunks"], "stored_tokens": stored,
        "pad_share": _share(t["pad_tokens"], stored), "dropped_token_share": _share(t["dropped_tokens"], t["tokens"]),
        "dropped_document_share": _share(t["dropped_documents"], t["documents"]),
        "input_bytes": m.get("inputs", {}).get("bytes"), "text_bytes": m["totals"].get("text_bytes"),
        "bytes_on_disk": bytes_on_disk(m, folder),
        "sources": {k: {**v, "token_share": _share(v["tokens"], t["tokens"])} for k, v in (m.get("sources") or {}).items()},
        "alerts": alerts(m),
        **({"chat": c} if (c := chat_counts(m)) else {}),
        # Where each document was read (docs/format.md `.src`): what `show` and the document view can say.
        "document_sources": "recorded" if m.get("unit_sources") is not None and m["packing"] != "document" else
        "not kept (document packing)" if m["packing"] == "document" else "unknown (written before they were kept)",
        # The records' fields kept beside them (--keep-fields), and how many bytes they take.
        "document_fields": {"names": (m.get("fields") or {}).get("names", []),
                            "bytes": sum(x["bytes"] for x in (m.get("fields") or {}).get("files", ()))},
    }


def source_name(key: str) -> str:
    """A source as people read it: its top-level folder, or the files directly in the corpus root
    (the manifest's "."), said alike by the summary and the HTML report."""
    return "(top-level files)" if key == "." else key


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} B"


def lines(s: dict, *, elapsed: float | None = None, reused: int = 0, units: int = 0) -> list[str]:
    """The summary's plain lines (after the table of splits), the alerts last."""
    bos = f"BOS {s['bos_token']}" if s["add_bos"] else "BOS as the template writes it" \
        if s["bos_rule"] == "chat template" else "no BOS"
    rule = "the tokenizer's rule" if s["bos_rule"] == "tokenizer" else s["bos_rule"]
    out = [f"backend {s['backend_version'] or s['backend']}"
           + (f" (checked against {s['reference_version']})" if s.get("reference_version") else "")
           + (f"; {bos}" if s["bos_rule"] == "chat template" else f"; {bos} ({rule})")]
    size = "" if s["bytes_on_disk"] is None else f"{human_bytes(s['bytes_on_disk'])} on disk"
    if elapsed is not None:
        # Text tokenized per second (what the progress lines count), and the files' size as read.
        rate = (f", {s['text_bytes'] / elapsed / 1e6:,.1f} MB/s of text ({human_bytes(s['input_bytes'])} of files)"
                if s.get("text_bytes") and s.get("input_bytes") and elapsed > 0 else "")
        out.append(f"took {elapsed:,.1f} s{rate}" + (f"; {size}" if size else ""))
    elif size:
        out.append(size)
    out.append(f"padding {s['pad_share']:.1%} of stored tokens; dropped {s['dropped_token_share']:.1%} of tokens, "
               f"{s['dropped_document_share']:.1%} of documents")
    if s.get("chat"):
        c = s["chat"]
        out.append(f"chat: {c['conversations']:,} conversations, {c['trainable_tokens']:,} tokens to train on "
                   f"({_share(c['trainable_tokens'], s['tokens']):.1%} of tokens)"
                   + (f", {c['truncated']:,} cut to --seq-len" if c["truncated"] else "")
                   + (f", {c['truncated_turns']:,} lost their earliest exchanges to fit" if c.get("truncated_turns")
                      else ""))
    if reused:
        out.append(f"resumed: {reused:,} of {units:,} work units reused from an interrupted run")
    if len(s["sources"]) > 1:
        out.append("sources: " + "; ".join(f"{source_name(k)} {v['tokens']:,} tokens ({v['token_share']:.1%}), "
                                           f"{v['documents']:,} documents" for k, v in s["sources"].items()))
    return out
