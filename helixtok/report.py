"""A built dataset as one self-contained HTML page: summary, tokens per source, length and fill histograms, a few chunks."""

from __future__ import annotations

import html
import os

import numpy as np

from .splitview import SplitView
from .summary import lines, summarize

_BAR_W, _BAR_H = 560, 160


def _bars(title: str, labels: list[str], values: list[int], unit: str) -> str:
    """An inline SVG bar chart: no script, no file beside the page."""
    if not values or max(values) == 0:
        return f"<h2>{html.escape(title)}</h2><p>nothing to show</p>"
    top, n = max(values), len(values)
    w = _BAR_W / n
    bars = "".join(
        f'<rect x="{i * w + 1:.1f}" y="{_BAR_H - v / top * _BAR_H:.1f}" width="{max(w - 2, 1):.1f}" '
        f'height="{v / top * _BAR_H:.1f}" fill="#3b6ea5"><title>{html.escape(lab)}: {v:,} {unit}</title></rect>'
        for i, (lab, v) in enumerate(zip(labels, values)))
    ticks = "".join(f'<text x="{i * w + w / 2:.1f}" y="{_BAR_H + 14}" font-size="10" text-anchor="middle">'
                    f"{html.escape(lab)}</text>" for i, lab in enumerate(labels) if n <= 12 or i % (n // 12 + 1) == 0)
    return (f"<h2>{html.escape(title)}</h2><svg width='{_BAR_W}' height='{_BAR_H + 20}' role='img' "
            f"aria-label='{html.escape(title)}'>{bars}{ticks}</svg><p class='top'>tallest bar: {top:,} {unit}</p>")


def _log2_buckets(x: np.ndarray) -> tuple[list[str], list[int]]:
    if not len(x):
        return [], []
    b = np.floor(np.log2(np.maximum(x, 1))).astype(int)
    counts = np.bincount(b)
    return [f"{1 << i >> 10}k" if i >= 10 else f"{1 << i}" for i in range(len(counts))], counts.tolist()


def render(out: str, m: dict, *, chunks: int = 3) -> str:
    """The page for the dataset in `out` (its manifest `m`)."""
    from .tokenizer import load_tokenizer

    from .show import chunk_segments

    summ = summarize(m, out)
    split = "train"
    parts = [f"<h1>{html.escape(os.path.basename(os.path.abspath(out)))}</h1>",
             f"<p>{m['packing']} packing, seq_len {m['seq_len']}, {m['dtype']}, "
             f"{m['totals']['chunks']:,} chunks, {m['totals']['tokens']:,} tokens from "
             f"{m['totals']['documents']:,} documents</p>",
             "<ul>" + "".join(f"<li>{html.escape(x)}</li>" for x in lines(summ)) + "</ul>"]
    if summ["alerts"]:
        parts.append("<ul class='warn'>" + "".join(f"<li>warning: {html.escape(a)}</li>" for a in summ["alerts"])
                     + "</ul>")
    src = summ["sources"]
    parts.append(_bars("Tokens per source", list(src), [v["tokens"] for v in src.values()], "tokens"))
    if m["packing"] == "packed":
        labels, counts = _log2_buckets(SplitView(out, m, split).document_lengths())
        parts.append(_bars("Document lengths (tokens, powers of two)", labels, counts, "documents"))
        parts.append(_bars("Chunk fill", ["100%"], [m["splits"][split]["num_chunks"]], "chunks"))
    else:
        fill = SplitView(out, m, split).all_valid().astype(np.int64)
        L = int(m["seq_len"])
        counts = np.bincount(np.minimum(fill * 10 // L, 10), minlength=11).tolist()
        parts.append(_bars("Chunk fill (real tokens per chunk)", [f"{10 * i}%" for i in range(11)], counts, "chunks"))
    tok = load_tokenizer(os.path.join(out, m["tokenizer"]["file"]))
    n = m["splits"][split]["num_chunks"]
    parts.append("<h2>Chunks</h2>")
    for i in sorted({0, n // 2, n - 1})[:chunks] if n else []:
        segs = "".join(
            f"<span class='doc{k % 2}' title='document {s.document if s.document is not None else '?'}'>"
            f"{html.escape(tok.decode(s.ids, skip_special_tokens=False))}</span>"
            + (f"<span class='pad'>[{s.pad} pad]</span>" if s.pad else "")
            for k, s in enumerate(chunk_segments(out, m, split, i)))
        parts.append(f"<h3>chunk {i:,}</h3><pre>{segs}</pre>")
    style = ("body{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}"
             "pre{white-space:pre-wrap;background:#f6f6f6;padding:.6em;font-size:12px}"
             ".doc0{background:#e3edf7}.doc1{background:#f7eee3}.pad{color:#999}.warn{color:#a0522d}"
             ".top{font-size:11px;color:#666;margin-top:0}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>helixtok: {html.escape(out)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")
