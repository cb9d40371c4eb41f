"""Look inside a built dataset: a chunk's ids cut at document boundaries, and where each document came from."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from ..format.errors import ConfigError
from ..format.planid import PLAN_FILE
from ..read.splitview import SplitView

TRAIN_OPEN, TRAIN_CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧ around what a chat build trains, in `helixtok show`


@dataclass
class Segment:
    """Consecutive ids of one document inside a chunk; `pad` pad ids follow (document packing)."""

    ids: list[int]
    document: int | None  # the document's index in the split (packed data), else None
    starts: bool | None  # the document starts in this chunk, or began in an earlier one (None: not known)
    pad: int = 0
    mask: list[int] | None = None  # a chat build's: 1 where the id trains


def trained_runs(seg: Segment) -> list[tuple[list[int], bool]]:
    """A segment's ids in runs that train or not (one run, False, without a mask)."""
    if seg.mask is None:
        return [(seg.ids, False)]
    runs: list[tuple[list[int], bool]] = []
    for t, k in zip(seg.ids, seg.mask):
        if runs and runs[-1][1] == bool(k):
            runs[-1][0].append(t)
        else:
            runs.append(([t], bool(k)))
    return runs


def chunk_segments(out: str, m: dict, split: str, index: int) -> list[Segment]:
    """Chunk `index` of `split`, cut where documents start (packed: the .docs sidecars; bestfit: its
    index's items) and where padding begins (document: the .valid sidecars; bestfit: its index)."""
    view = SplitView(out, m, split)
    L = view.L
    ids = view.chunk(index).tolist()
    mask = view.chunk(index, "mask").tolist() if m.get("chat") else None
    valid = view.valid(index)
    if m["packing"] == "document":
        return [Segment(ids[:valid], None, None, pad=L - valid, mask=mask and mask[:valid])]
    lo = index * L
    cuts = view.chunk_starts(index).tolist()
    bounds = ([0] if not cuts or cuts[0] != 0 else []) + cuts + [valid]
    # Packed: documents are numbered by their starts (the first id may continue an earlier one);
    # a bestfit chunk's pieces are not numbered (pieces of long documents start too).
    doc = view.starts_before(lo) - (not cuts or cuts[0] != 0) if m["packing"] == "packed" else -1
    # A bestfit chunk's items are numbered by the document each lies in, where builds say where
    # documents were read (an item is a document, or a seq_len piece of one).
    lay = view.pieces() if m["packing"] == "bestfit" and m.get("unit_sources") is not None else None
    items = [g for g, _ in zip(*lay.pieces(index))] if lay is not None else []
    segs = []
    for j, (a, b) in enumerate(zip(bounds, bounds[1:])):
        if lay is not None and j < len(items):
            d = view.starts_before(items[j] + 1) - 1
            segs.append(Segment(ids[a:b], d, view.starts_before(items[j]) == d, mask=mask and mask[a:b]))
            continue
        known = m["packing"] == "packed" and doc >= 0
        segs.append(Segment(ids[a:b], doc if known else None, a in cuts, mask=mask and mask[a:b]))
        doc += 1
    segs[-1].pad = L - valid
    return segs


def document_source(out: str, m: dict, split: str, doc: int, corpus: str | None = None) -> str:
    """Where document `doc` of `split` came from: its work unit's file(s), and with `corpus` (the
    folder or files the build read) the exact file:line or file row N, read again; then the fields
    of its record the build kept (--keep-fields), as JSON."""
    if m.get("unit_sources") is not None and m["packing"] != "document":  # recorded by the build: exact
        view = SplitView(out, m, split)
        got = view.document_source(doc)
        if got is not None:
            kept = view.document_fields(doc)
            return got + (f" {json.dumps(kept, ensure_ascii=False)}" if kept else "")
    counts = (m.get("unit_documents") or {}).get(split)
    if counts is None:
        return "unknown (built by an older helixtok)"
    cum = np.cumsum(counts)
    u = int(np.searchsorted(cum, doc, side="right"))
    if u >= len(counts):
        raise ConfigError(f"document {doc} outside the {int(cum[-1]) if len(cum) else 0} of this split")
    nth = doc - (int(cum[u - 1]) if u else 0)
    # A merged dataset's parts all hold the whole plan, and its unit_documents run over all units.
    where = os.path.join(out, m["merged_from"][0]) if m.get("merged_from") else out
    try:
        with open(os.path.join(where, PLAN_FILE)) as fh:
            plan = json.load(fh)
    except (OSError, ValueError):
        return "unknown (no build plan)"
    unit = plan["units"][u]
    files = unit["files"]
    named = files[0] if len(files) == 1 else f"one of {files[0]} … {files[-1]} ({len(files)} files)"
    if corpus is None:
        return f"{named} (work unit {u}; --corpus for the line)"
    return _locate(corpus, plan, u, split, nth) or f"{named} (work unit {u}; the corpus has changed since)"


def _locate(corpus: str, plan: dict, u: int, split: str, nth: int) -> str | None:
    """The nth kept document of `split` in unit u, found by reading the unit again as the build did."""
    from ..pipeline.config import BuildConfig
    from ..pipeline.discover import discover
    from ..pipeline.longdoc import LongText
    from ..pipeline.sources import LineRefs, RecordMap, UnitReader
    from ..pipeline.tally import Tally
    from ..pipeline.unit import kept, kept_long
    from ..pipeline.units import plan_units

    cfg = BuildConfig(**{k: v for k, v in plan["config"].items() if k in BuildConfig.__dataclass_fields__})
    files, _ = discover([corpus], code=cfg.code)
    units, _ = plan_units(files, unit_bytes=cfg.unit_bytes, text_field=cfg.text_field)
    if [x.to_json() for x in units] != plan["units"]:
        return None
    want = 0 if split == "train" else 1
    refs = LineRefs(units)  # a range's lines are numbered once the ranges before it in its file are counted
    for v in units[:u]:
        if v.files == units[u].files and v.kind == units[u].kind:
            r = UnitReader(v, cfg.text_field, Tally())
            for _ in r:
                pass
            refs.record(v.index, r.lines)
    reader = UnitReader(units[u], cfg.text_field, Tally(), long_bytes=cfg.long_doc_bytes, mapper=RecordMap.of(cfg))
    for text in reader:
        s = (kept_long if isinstance(text, LongText) else kept)(text, cfg)[1]
        if s == want:
            if nth == 0:
                return refs.resolve(reader.where())
            nth -= 1
    return None
