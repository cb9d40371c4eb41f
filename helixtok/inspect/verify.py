"""helixtok verify: prove a dataset on disk is what its manifest says, shard by shard."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from ..format.bestfit import build_index, doc_spans
from ..format.errors import DatasetError
from ..format.manifest import DTYPES, Digest, load_manifest, shard_tokens
from ..format.objstore import Folder, reports_storage_errors
from ..format.shards import DOCS_DTYPE, MASK_DTYPE, VALID_DTYPE
from ..format.tokenizer_file import sha256_stream
from ..read.splitview import SplitView

BLOCK = 1 << 24  # elements per read: memory stays flat on large shards


@dataclass
class ShardReport:
    split: str
    path: str
    ok: bool
    problems: list[str] = field(default_factory=list)
    max_id: int | None = None


@dataclass
class VerifyReport:
    shards: list[ShardReport]
    problems: list[str]  # dataset-level problems (counts that do not add up)
    samples: list[dict]

    @property
    def ok(self) -> bool:
        return not self.problems and all(s.ok for s in self.shards)

    def to_json(self) -> dict:
        return {"ok": self.ok, "problems": self.problems, "samples": self.samples,
                "shards": [s.__dict__ for s in self.shards]}


def _hash_and_max(fh, dtype: np.dtype, x: dict) -> tuple[bool, int]:
    """Whether the shard's bytes are what its entry says (Digest), and its largest id."""
    h = Digest(x)
    mx = -1
    with fh:
        while True:
            buf = fh.read(BLOCK * dtype.itemsize)
            if not buf:
                break
            h.update(buf)
            arr = np.frombuffer(buf, dtype=dtype)
            if len(arr):
                mx = max(mx, int(arr.max()))
    return h.ok(), mx


@reports_storage_errors
def verify(out: str, *, sample: int = 0, seed: int = 0) -> VerifyReport:
    """Check every file against the manifest (a local folder or a URL: then read over the network)."""
    m = load_manifest(out)
    d = Folder(out)
    dtype = np.dtype(DTYPES[m["dtype"]])
    L = m["seq_len"]
    vocab = m["tokenizer"]["vocab_size"]
    reports, problems = [], []
    pad_seen = 0
    tok = m["tokenizer"]["file"]
    if d.size(tok) is None:
        problems.append(f"{tok}: missing (the tokenizer copy the data was built with)")
    elif sha256_stream(d.open(tok)) != m["tokenizer"]["sha256"]:
        problems.append(f"{m['tokenizer']['file']}: sha256 differs from the manifest's tokenizer.sha256 "
                        "(replaced or modified)")
    chat = m.get("chat")
    if chat:  # the template the masks came from, as the tokenizer is checked above
        f = chat["template_file"]
        if d.size(f) is None:
            problems.append(f"{f}: missing (the chat template the data was built with)")
        elif sha256_stream(d.open(f)) != chat["template_sha256"]:
            problems.append(f"{f}: sha256 differs from the manifest's chat.template_sha256 (replaced or modified)")
    for x in (m.get("fields") or {}).get("files", ()):  # the records' kept fields (format/fields.py)
        if d.size(x["path"]) != x["bytes"]:
            problems.append(f"{x['path']}: missing or not {x['bytes']} bytes (the documents' kept fields)")
        elif sha256_stream(d.open(x["path"])) != x["sha256"]:
            problems.append(f"{x['path']}: sha256 differs from the manifest's (replaced or modified)")
    for split, s in m["splits"].items():
        stream = sum(shard_tokens(e, L) for e in s["shards"])
        if m["packing"] != "bestfit" and (stream // L != s["num_chunks"] or
                                          (m["packing"] != "packed" and stream != s["num_chunks"] * L)):
            problems.append(f"{split}: shards hold {stream} tokens, num_chunks says {s['num_chunks']} chunks of {L}")
        if s["num_tokens"] != s["num_chunks"] * L:
            problems.append(f"{split}: num_tokens {s['num_tokens']} != num_chunks x seq_len")
        if s["tokens"] + s["pad_tokens"] - s["dropped_tokens"] != s["num_tokens"]:
            problems.append(f"{split}: tokens + pad_tokens - dropped_tokens != num_tokens")
        starts = sum(e["docs"]["count"] for e in s["shards"] if "docs" in e)
        # Packed: every document starts in the stream on disk (version 1 kept no partial chunk: a
        # document, of >= 1 token, may lie wholly in the dropped remainder).  Bestfit: every kept
        # document starts at least one piece.
        slack = s["dropped_tokens"] if m["format_version"] == 1 else 0
        if m["packing"] != "document" and not 0 <= s["documents"] - starts <= slack:
            problems.append(f"{split}: .docs sidecars hold {starts} document starts for {s['documents']} documents "
                            f"and {s['dropped_tokens']} dropped tokens")
        doc_offsets = []  # bestfit: (tokens, .docs offsets) of each shard, for its index
        trainable = 0  # a chat build's: tokens whose mask is 1
        for e in s["shards"]:
            r = ShardReport(split, e["path"], True)
            reports.append(r)
            size = d.size(e["path"])
            n = shard_tokens(e, L)
            if size is None:
                r.problems.append("missing")
            else:
                want = n * dtype.itemsize
                if size != want:
                    r.problems.append(f"size {size} bytes, expected {want}")
                else:
                    same, r.max_id = _hash_and_max(d.open(e["path"]), dtype, e)
                    if not same:
                        r.problems.append("sha256 mismatch (corrupt or modified)")
                    if r.max_id >= vocab:
                        r.problems.append(f"holds id {r.max_id} >= vocab_size {vocab}")
            if "mask" in e:
                trainable += _check_mask(d, e["mask"], n, r)
            for side in ("valid", "docs"):
                if side not in e:
                    continue
                sp = e[side]["path"]
                if d.size(sp) is None:
                    r.problems.append(f"{sp} missing")
                    continue
                with d.open(sp) as fh:
                    raw = fh.read()
                if hashlib.sha256(raw).hexdigest() != e[side]["sha256"]:
                    r.problems.append(f"{sp}: sha256 mismatch")
                    continue
                if side == "valid":
                    v = np.frombuffer(raw, dtype=VALID_DTYPE)
                    if len(v) != n // L or (len(v) and (v.min() < 1 or v.max() > L)):
                        r.problems.append(f"{e[side]['path']}: valid lengths out of range")
                    pad_seen += int((L - v.astype(np.int64)).sum())
                else:
                    ds = np.frombuffer(raw, dtype=DOCS_DTYPE)
                    if len(ds) != e[side]["count"] or (len(ds) and (np.any(np.diff(ds.astype(np.int64)) <= 0)
                                                                     or ds.max() >= n)):
                        r.problems.append(f"{e[side]['path']}: document offsets not sorted or out of range")
                    doc_offsets.append((n, ds))
            r.ok = not r.problems
        if m["packing"] == "bestfit" and all(x.ok for x in reports):
            problems += _check_index(d, m, split, s, doc_offsets)
        if m.get("chat") and all(x.ok for x in reports) and trainable != s["chat"]["trainable_tokens"]:
            problems.append(f"{split}: the .mask files mark {trainable} tokens to train, chat.trainable_tokens says "
                            f"{s['chat']['trainable_tokens']}")
    if m["packing"] == "document" and all(x.ok for x in reports):
        if pad_seen != m["totals"]["pad_tokens"]:
            problems.append(f"padding in .valid files sums to {pad_seen}, totals.pad_tokens is "
                            f"{m['totals']['pad_tokens']}")
    samples = _samples(d, m, dtype, sample, seed) if sample and all(x.ok for x in reports) else []
    return VerifyReport(reports, problems, samples)


def _check_mask(d: Folder, x: dict, n: int, r: ShardReport) -> int:
    """A chat shard's .mask: n bytes of 0 or 1 with its recorded sha256; returns how many are 1."""
    if d.size(x["path"]) != n:
        r.problems.append(f"{x['path']}: missing or not {n} bytes (one a token)")
        return 0
    h, ones, bad = Digest(x), 0, False
    with d.open(x["path"]) as fh:
        while buf := fh.read(BLOCK):
            h.update(buf)
            a = np.frombuffer(buf, dtype=MASK_DTYPE)
            bad |= bool(len(a)) and int(a.max()) > 1
            ones += int(np.count_nonzero(a))
    if not h.ok():
        r.problems.append(f"{x['path']}: sha256 mismatch (corrupt or modified)")
    elif bad:
        r.problems.append(f"{x['path']}: holds values other than 0 and 1")
    return ones


def _check_index(d: Folder, m: dict, split: str, s: dict, doc_offsets: list) -> list[str]:
    """A bestfit split's index: its files' sha256, and the very index its documents' lengths give."""
    out = []
    for x in s["index"].values():
        if d.size(x["path"]) is None:
            return [f"{x['path']}: missing (the split's bestfit index)"]
        with d.open(x["path"]) as fh:
            if hashlib.sha256(fh.read()).hexdigest() != x["sha256"]:
                out.append(f"{x['path']}: sha256 mismatch (corrupt or modified)")
    if out:
        return out
    try:
        got = SplitView(d, m, split).bestfit_index()
    except DatasetError as e:
        return [str(e)]
    want = build_index(*doc_spans(doc_offsets), int(m["seq_len"]), int(m["min_tail_len"] or 0))
    if not (np.array_equal(got.pos, want.pos) and np.array_equal(got.size, want.size)
            and np.array_equal(got.first, want.first)):
        out.append(f"{split}: its index is not the one its documents' lengths give (docs/format.md); rebuild")
    for k in ("pad_tokens", "dropped_tokens", "dropped_documents"):
        if s[k] != getattr(want, k):
            out.append(f"{split}: {k} {s[k]}, the index gives {getattr(want, k)}")
    return out


def _samples(d: Folder, m: dict, dtype: np.dtype, n: int, seed: int) -> list[dict]:
    from ..format.tokenizer_file import tokenizer_from_bytes

    with d.open(m["tokenizer"]["file"]) as fh:
        tok = tokenizer_from_bytes(fh.read(), m["tokenizer"]["file"])
    rng = np.random.default_rng(seed)
    view = SplitView(d, m, "train")
    picked = []
    for i in sorted(rng.choice(view.num_chunks, size=min(n, view.num_chunks), replace=False).tolist()):
        ids = view.chunk(i).tolist()
        picked.append({"chunk": i, "text": tok.decode(ids, skip_special_tokens=False)[:200]})
    return picked
