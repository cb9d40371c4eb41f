"""A built dataset as one self-contained HTML page: summary, tokens per source, length and fill histograms, a few chunks."""

from __future__ import annotations

import html
import os

import numpy as np

from ..read.splitview import SplitView
from .summary import lines, source_name, summarize

_BAR_W, _BAR_H, _AXIS = 560, 160, 56  # plot area and the room left of it for the y axis's values


def _bars(title: str, labels: list[str], values: list[int], unit: str) -> str:
    """An inline SVG bar chart (no script, no file beside the page): a y axis with its values,
    each bar's value above it where there is room, labels below."""
    if not values or max(values) == 0:
        return f"<h2>{html.escape(title)}</h2><p>nothing to show</p>"
    top, n = max(values), len(values)
    w = _BAR_W / n
    x0, y0 = _AXIS, 14  # the plot's left edge; room above the tallest bar for its value
    axis = "".join(
        f'<line x1="{x0 - 4}" x2="{x0 + _BAR_W}" y1="{y0 + _BAR_H * (1 - f):.1f}" y2="{y0 + _BAR_H * (1 - f):.1f}" '
        f'stroke="#ccc" stroke-width="1"/><text x="{x0 - 6}" y="{y0 + _BAR_H * (1 - f) + 3:.1f}" font-size="10" '
        f'text-anchor="end">{round(top * f):,}</text>' for f in (0, 0.5, 1))
    bars = "".join(
        f'<rect x="{x0 + i * w + 1:.1f}" y="{y0 + _BAR_H - v / top * _BAR_H:.1f}" width="{max(w - 2, 1):.1f}" '
        f'height="{v / top * _BAR_H:.1f}" fill="#3b6ea5"><title>{html.escape(lab)}: {v:,} {unit}</title></rect>'
        + (f'<text x="{x0 + i * w + w / 2:.1f}" y="{y0 + _BAR_H - v / top * _BAR_H - 3:.1f}" font-size="9" '
           f'text-anchor="middle">{v:,}</text>' if n <= 16 and v else "")
        for i, (lab, v) in enumerate(zip(labels, values)))
    ticks = "".join(f'<text x="{x0 + i * w + w / 2:.1f}" y="{y0 + _BAR_H + 14}" font-size="10" text-anchor="middle">'
                    f"{html.escape(lab)}</text>" for i, lab in enumerate(labels) if n <= 12 or i % (n // 12 + 1) == 0)
    return (f"<h2>{html.escape(title)}</h2><svg width='{x0 + _BAR_W + 4}' height='{y0 + _BAR_H + 34}' role='img' "
            f"aria-label='{html.escape(title)}'>{axis}{bars}{ticks}<text x='{x0 + _BAR_W / 2}' "
            f"y='{y0 + _BAR_H + 30}' font-size='10' text-anchor='middle' fill='#666'>{html.escape(unit)} per bar"
            f"</text></svg>")


def _split_table(m: dict) -> str:
    """Every split's counts, side by side."""
    cols = {"documents": "documents", "num_chunks": "chunks", "num_tokens": "stored tokens",
            "tokens": "produced tokens", "pad_tokens": "pad", "dropped_tokens": "dropped"}
    head = "".join(f"<th>{label}</th>" for label in cols.values())
    rows = "".join(f"<tr><th>{html.escape(name)}</th>" + "".join(f"<td>{s.get(c, 0):,}</td>" for c in cols) + "</tr>"
                   for name, s in m["splits"].items())
    return f"<h2>Splits</h2><table><tr><th>split</th>{head}</tr>{rows}</table>"


def _log2_buckets(x: np.ndarray) -> tuple[list[str], list[int]]:
    if not len(x):
        return [], []
    b = np.floor(np.log2(np.maximum(x, 1))).astype(int)
    counts = np.bincount(b)
    return [f"{1 << i >> 10}k" if i >= 10 else f"{1 << i}" for i in range(len(counts))], counts.tolist()


def render(out: str, m: dict, *, chunks: int = 3) -> str:
    """The page for the dataset in `out` (its manifest `m`)."""
    from ..format.tokenizer_file import load_tokenizer
    from .show import chunk_segments, trained_runs

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
    parts.append(_split_table(m))
    src = summ["sources"]
    # "." is the files directly in the corpus folder (docs/format.md): named so on the chart.
    parts.append(_bars("Tokens per source", [source_name(k) for k in src],
                       [v["tokens"] for v in src.values()], "tokens"))
    view = SplitView(out, m, split)
    # The charts that say something for each packing: packed chunks are all full (no fill chart);
    # document packing keeps no document starts (no length chart).
    if m["packing"] == "packed":
        labels, counts = _log2_buckets(view.document_lengths())
        parts.append(_bars(f"Document lengths in {split} (tokens, powers of two)", labels, counts, "documents"))
        parts.append(f"<p>Every {split} chunk is full: packed data has no padding.</p>")
    if m["packing"] == "bestfit":
        labels, counts = _log2_buckets(view.pieces().size)
        parts.append(_bars(f"Document lengths in {split} (tokens, powers of two; longer than seq_len: its pieces)",
                           labels, counts, "documents"))
    if m["packing"] != "packed":
        fill = view.all_valid().astype(np.int64)
        L = int(m["seq_len"])
        counts = np.bincount(np.minimum(fill * 10 // L, 10), minlength=11).tolist()
        parts.append(_bars(f"Chunk fill in {split} (real tokens per chunk)", [f"{10 * i}%" for i in range(11)],
                           counts, "chunks"))
    tok = load_tokenizer(os.path.join(out, m["tokenizer"]["file"]))
    n = m["splits"][split]["num_chunks"]
    parts.append("<h2>Chunks</h2>" + ("<p>Bold: the tokens that train (the chat build's mask).</p>"
                                       if m.get("chat") else ""))
    for i in sorted({0, n // 2, n - 1})[:chunks] if n else []:
        segs = "".join(
            f"<span class='doc{k % 2}' title='document {s.document if s.document is not None else '?'}'>"
            + "".join(f"<b class='train'>{html.escape(tok.decode(ids, skip_special_tokens=False))}</b>" if trains
                      else html.escape(tok.decode(ids, skip_special_tokens=False)) for ids, trains in trained_runs(s))
            + "</span>"
            + (f"<span class='pad'>[{s.pad} pad]</span>" if s.pad else "")
            for k, s in enumerate(chunk_segments(out, m, split, i)))
        parts.append(f"<h3>chunk {i:,}</h3><pre>{segs}</pre>")
    return _page(out, parts)


_STYLE = ("body{font-family:sans-serif;max-width:900px;margin:2em auto;color:#222}"
          "pre{white-space:pre-wrap;background:#f6f6f6;padding:.6em;font-size:12px}"
          ".doc0{background:#e3edf7}.doc1{background:#f7eee3}.pad{color:#999}.warn{color:#a0522d}"
          ".train{color:#1a5e20}"
          "table{border-collapse:collapse;font-size:13px}td,th{padding:.2em .7em;text-align:right}"
          "tr:nth-child(even){background:#f3f3f3}")
_COLOURS = ("#3b6ea5", "#e08a3c", "#5aa469", "#c0504d", "#8064a2", "#4bacc6", "#9b7d3a", "#777777")


def _page(title: str, parts: list[str]) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>helixtok: {html.escape(title)}</title>"
            f"<style>{_STYLE}</style></head><body>{''.join(parts)}</body></html>\n")


def render_mixture(path: str, st: dict) -> str:
    """A mixture file's run: each source's share of every optimizer step over training (one band per
    stage, as wide as its steps), and the counts per stage and source."""
    steps, names = st["optimizer_steps"], list(st["sources"])
    x0, y0 = _AXIS, 14
    bands = []
    for s in st["stages"]:
        x, w = x0 + _BAR_W * s["first_step"] / steps, _BAR_W * s["steps"] / steps
        y = y0
        for k, n in enumerate(names):
            v = s["sources"][n]
            h = _BAR_H * v["samples"] / s["samples"]
            if h:
                bands.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{h:.1f}" '
                             f'fill="{_COLOURS[k % len(_COLOURS)]}"><title>stage {s["stage"]}, {html.escape(n)}: '
                             f'{v["samples"]:,} samples ({v["samples"] / s["samples"]:.1%})</title></rect>')
            y += h
    axis = "".join(f'<text x="{x0 - 6}" y="{y0 + _BAR_H * f + 3:.1f}" font-size="10" text-anchor="end">'
                   f'{1 - f:.0%}</text>' for f in (0, 0.5, 1))
    ticks = "".join(f'<text x="{x0 + _BAR_W * s["first_step"] / steps:.1f}" y="{y0 + _BAR_H + 14}" font-size="10">'
                    f'{s["first_step"]:,}</text>' for s in st["stages"]) + \
        f'<text x="{x0 + _BAR_W}" y="{y0 + _BAR_H + 14}" font-size="10" text-anchor="end">{steps:,}</text>'
    legend = " ".join(f"<span style='color:{_COLOURS[k % len(_COLOURS)]}'>&#9632;</span> {html.escape(n)}"
                      for k, n in enumerate(names))
    rows = "".join(f"<tr><td>{s['stage']}</td><td>{s['first_step']:,}-{s['first_step'] + s['steps']:,}</td>"
                   f"<th>{html.escape(n)}</th><td>{v['samples']:,}</td><td>{v['tokens']:,}</td>"
                   f"<td>{v['epochs_of_source']:.2f}</td><td>{v['epochs_so_far']:.2f}</td></tr>"
                   for s in st["stages"] for n, v in s["sources"].items())
    parts = [f"<h1>{html.escape(os.path.basename(path))}</h1>",
             f"<p>{steps:,} optimizer steps of {st['global_batch']:,} samples, {st['tokens']:,} tokens, "
             f"{len(st['stages'])} stages</p>",
             "<h2>Each source's share of every step over training</h2>",
             f"<svg width='{x0 + _BAR_W + 4}' height='{y0 + _BAR_H + 34}' role='img' aria-label='shares'>{axis}"
             f"{''.join(bands)}{ticks}<text x='{x0 + _BAR_W / 2}' y='{y0 + _BAR_H + 30}' font-size='10' "
             f"text-anchor='middle' fill='#666'>optimizer step</text></svg><p>{legend}</p>",
             "<h2>Per stage and source</h2><table><tr><th>stage</th><th>steps</th><th>source</th><th>samples</th>"
             f"<th>tokens</th><th>epochs of source</th><th>epochs so far</th></tr>{rows}</table>"]
    return _page(path, parts)
