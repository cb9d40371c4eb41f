"""bestfit's placing and an epoch's layout at scale, on document lengths alone (no build): one core's
time per 100 M tokens and the padding, for a web-like length mix (log-normal, median ~330 tokens).

Usage: python scripts/bench_index.py [--documents 250000 2500000] [--seq-lens 512 2048 8192]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helixtok.format.bestfit import build_index  # noqa: E402
from helixtok.read.layout import bestfit_pieces, shuffled_documents  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--documents", type=int, nargs="+", default=[250_000, 2_500_000])
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 8192])
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| documents | tokens | seq_len | place (s) | s / 100 M tokens | padding | chunks over the bound "
          "| epoch layout bestfit / packed (s / 100 M) |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n in a.documents:
        lens = np.maximum(2, rng.lognormal(5.8, 1.0, n).astype(np.int64))
        pos = np.concatenate(([0], np.cumsum(lens)[:-1]))
        T = int(lens.sum())
        per = 1e8 / T
        for L in a.seq_lens:
            t = time.perf_counter()
            idx = build_index(pos, lens, L, 0)
            place = time.perf_counter() - t
            t = time.perf_counter()
            bestfit_pieces(idx, 0, 1)
            bf = time.perf_counter() - t
            t = time.perf_counter()
            shuffled_documents(pos, lens, L, 0, 1)
            pk = time.perf_counter() - t
            print(f"| {n:,} | {T / 1e6:,.0f} M | {L} | {place:.2f} | {place * per:.2f} | "
                  f"{idx.pad_tokens / (idx.num_chunks * L):.3%} | {idx.num_chunks - -(-T // L):,} | "
                  f"{bf * per:.3f} / {pk * per:.3f} |")


if __name__ == "__main__":
    main()
