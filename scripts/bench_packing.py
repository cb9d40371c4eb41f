"""Packings side by side: padding, cut documents, dropped tokens and build time, with OLMo-core's and nanochat's best fit.

Usage: python scripts/bench_packing.py --corpus ../shared/corpus/dev --tokenizer tok.json
           [--seq-lens 512 2048 8192] [--copies 1 10] [--workers 2]
           [--olmo-core SITE]     a folder holding ai2-olmo-core (pip install --target SITE ai2-olmo-core ...)
           [--nanochat REPO]      a nanochat checkout (git clone https://github.com/karpathy/nanochat)

helixtok's three packings are built (the --copies 10 corpus is ten symlinked copies of the corpus);
OLMo-core's InstancePacker (best-fit decreasing over the whole corpus, long documents fragmented at
seq_len) and nanochat's BOS-aligned best-fit loader (buffer of 1000 documents, rows of T + 1, crops
when nothing fits) run on the same documents' token lengths, taken from the packed build.
"cut" counts pieces beyond the minimum ceil(m / seq_len) a document of m tokens needs. The
"whole split" row is best-fit decreasing done here, apart from helixtok's code: helixtok's bestfit
row should equal it. Each table ends with the time to build the bestfit index and an epoch's
layout (repack) per 100 M tokens.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from helixtok.pipeline.builder import build  # noqa: E402
from helixtok.pipeline.config import BuildConfig  # noqa: E402
from helixtok.read.splitview import SplitView  # noqa: E402


def corpus_copies(corpus: str, n: int, tmp: str) -> str:
    if n == 1:
        return corpus
    root = os.path.join(tmp, f"x{n}")
    for k in range(n):  # copies: links to one file are one input (duplicate_file)
        for d, _, names in os.walk(corpus):
            rel = os.path.relpath(d, corpus)
            os.makedirs(os.path.join(root, f"copy{k:02d}", rel), exist_ok=True)
            for f in names:
                shutil.copyfile(os.path.join(d, f), os.path.join(root, f"copy{k:02d}", rel, f))
    return root


def packed_cuts(lengths: np.ndarray, L: int) -> int:
    """Pieces beyond the minimum when documents are concatenated and cut every L tokens."""
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    touched = (starts + lengths - 1) // L - starts // L + 1
    return int((touched - -(-lengths // L)).sum())


def olmo_core(lengths: np.ndarray, L: int, site: str) -> dict:
    sys.path.insert(0, site)
    from olmo_core.data.utils import InstancePacker

    # Its "fragment" long-document strategy: seq_len pieces, the last one shorter.
    pieces = np.concatenate([np.minimum(L, m - np.arange(0, m, L)) for m in lengths.tolist()])
    ends = np.cumsum(pieces)
    idx = np.stack([ends - pieces, ends], axis=1).astype(np.uint64)
    t = time.perf_counter()
    bins, _, total = InstancePacker(L).pack_documents(idx)
    dt = time.perf_counter() - t
    stored = len(bins) * L
    return {"pad": (stored - total) / stored, "cut": 0, "dropped": 0.0, "time": dt, "docs_dropped": 0}


def nanochat(lengths: np.ndarray, L: int, repo: str) -> dict:
    """nanochat's own loader on these lengths: its documents stand in for a tokenizer's output."""
    sys.path.insert(0, repo)
    import nanochat.dataloader as dl
    import torch

    docs = [[0] * m for m in lengths.tolist()]  # the ids do not matter, only the lengths
    taken = [0]

    def batches(split, state, batch_size):
        for a in range(0, len(docs), batch_size):
            yield docs[a: a + batch_size], (0, 0, 1)

    class Tok:
        def get_bos_token_id(self):
            return 0

        def encode(self, batch, prepend=None, num_threads=1):
            taken[0] += sum(map(len, batch))
            return batch

    dl._document_batches = lambda split, state, size: batches(split, state, size)
    B = 8
    rows = 0
    t = time.perf_counter()
    gen = dl.tokenizing_distributed_data_loader_with_state_bos_bestfit(Tok(), B, L, "train", device="cpu")
    try:
        for _ in gen:
            rows += B
    except (RuntimeError, StopIteration):  # the corpus ran out while refilling its buffer
        pass
    dt = time.perf_counter() - t
    del torch
    # Rows hold T + 1 tokens of documents; the documents still in its buffer at the end were
    # never placed, so they count neither as used nor as cropped.
    left = 1000 * float(lengths.mean())  # about the buffer it holds when the corpus runs out
    used = taken[0] - left
    return {"pad": 0.0, "cut": None, "dropped": max(0.0, (used - rows * (L + 1)) / used), "time": dt,
            "docs_dropped": None}


def whole_split(lengths: np.ndarray, L: int) -> dict:
    """Best-fit decreasing over every document of the split, done independently of the build:
    the same items -- documents, longer ones in seq_len pieces at fixed positions -- placed by a
    plain best fit (bisect over the open bins' rooms), on lengths alone."""
    import bisect

    items = sorted([int(m) % L for m in lengths if int(m) % L], reverse=True)
    t = time.perf_counter()
    rooms: list[int] = []  # sorted rooms of the open bins
    chunks = int(sum(int(m) // L for m in lengths))
    for s in items:
        j = bisect.bisect_left(rooms, s)
        if j == len(rooms):
            chunks += 1
            r = L - s
        else:
            r = rooms.pop(j) - s
        if r:
            bisect.insort(rooms, r)
    return {"pad": (chunks * L - int(lengths.sum())) / (chunks * L), "dropped": 0.0, "docs_dropped": 0, "cut": 0,
            "time": time.perf_counter() - t}


def epoch_index_times(lengths: np.ndarray, L: int) -> str:
    """One core's time to build the bestfit index and each epoch's layout, per 100 M tokens."""
    from helixtok.format.bestfit import build_index
    from helixtok.read.layout import bestfit_pieces, shuffled_documents

    pos = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    per = 1e8 / float(lengths.sum())
    t = time.perf_counter()
    idx = build_index(pos, lengths, L, 0)
    t_index = time.perf_counter() - t
    t = time.perf_counter()
    bestfit_pieces(idx, seed=0, epoch=1)
    t_bf = time.perf_counter() - t
    t = time.perf_counter()
    shuffled_documents(pos, lengths, L, seed=0, epoch=1)
    t_packed = time.perf_counter() - t
    return (f"per 100 M tokens, one core: bestfit index {t_index * per:.2f} s (once, at build); an epoch's "
            f"layout: bestfit {t_bf * per:.2f} s, packed {t_packed * per:.2f} s")


def helixtok_row(m: dict, dt: float) -> dict:
    t = m["totals"]
    return {"pad": t["pad_tokens"] / t["stored_tokens"], "dropped": t["dropped_tokens"] / t["tokens"],
            "docs_dropped": t["dropped_documents"], "time": dt}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--copies", type=int, nargs="+", default=[1])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--olmo-core")
    ap.add_argument("--nanochat")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-packing-")
    try:
        for n in a.copies:
            corpus = corpus_copies(a.corpus, n, tmp)
            for L in a.seq_lens:
                rows, lengths = {}, None
                for packing in ("packed", "document", "bestfit"):
                    out = os.path.join(tmp, f"{n}-{L}-{packing}")
                    t = time.perf_counter()
                    m = build([corpus], out, a.tokenizer, BuildConfig(seq_len=L, packing=packing, workers=a.workers))
                    rows[packing] = helixtok_row(m, time.perf_counter() - t)
                    if packing == "packed":
                        lengths = SplitView(out, m).document_lengths()
                        rows[packing]["cut"] = packed_cuts(lengths, L)
                    else:
                        rows[packing]["cut"] = 0  # pieces at fixed positions: the minimum
                    shutil.rmtree(out)
                rows["best-fit decreasing over the whole split (lengths only)"] = whole_split(lengths, L)
                if a.olmo_core:
                    rows["OLMo-core best fit (load time)"] = olmo_core(lengths, L, a.olmo_core)
                if a.nanochat:
                    rows["nanochat bos_bestfit (load time)"] = nanochat(lengths, L, a.nanochat)
                print(f"\n{n}x corpus, seq_len {L}: {len(lengths):,} documents, {int(lengths.sum()):,} tokens")
                print("| packing | padding | documents cut | tokens dropped | documents dropped | time |")
                print("|---|---:|---:|---:|---:|---:|")
                for k, r in rows.items():
                    cut = "-" if r["cut"] is None else f"{r['cut']:,}"
                    dd = "-" if r["docs_dropped"] is None else f"{r['docs_dropped']:,}"
                    print(f"| {k} | {100 * r['pad']:.2f}% | {cut} | {100 * r['dropped']:.2f}% | {dd} | {r['time']:.2f} s |")
                print(epoch_index_times(lengths, L))
                sys.stdout.flush()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
