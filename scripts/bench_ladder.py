"""Where a one-process build's time goes beyond the limit: the limit's loop, then the build's pieces added one at a time.

Usage: python scripts/bench_ladder.py CORPUS --tokenizer tok.json [--repeat 3] [--steps 0 1 2 3]

Steps, in one process, alternating, best of --repeat (give one step per run, e.g. --steps 3, to
see it in a fresh process):
  0  the limit's loop: read + parse every unit, encode 1 MiB batches with the backend the build
     picks, write the ids once to a file beside the corpus
  1  + helixtok's Encoder (EOS/BOS placed into one array)
  2  + what a unit counts per document (the split rule, sources, UTF-8 sizes)
  3  the build's own run_units (packing, shards hashed and fsynced, the journal), timed alone
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

NAMES = {0: "limit loop (read, parse, encode, write)", 1: "+ Encoder (EOS/BOS placed)",
         2: "+ per-document counts (split, sources, UTF-8)", 3: "the build's run_units (pack, shards, journal)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, nargs="+", default=[0, 1, 2, 3], choices=sorted(NAMES))
    args = ap.parse_args()

    from helixtok.pipeline import builder as hb
    from helixtok.pipeline.backend_check import choose_backend
    from helixtok.pipeline.backends import flat_encoder, hf_tokenizer
    from helixtok.pipeline.config import BuildConfig
    from helixtok.pipeline.discover import discover
    from helixtok.pipeline.encode import Encoder
    from helixtok.pipeline.longdoc import utf8_len
    from helixtok.pipeline.sources import UnitReader
    from helixtok.pipeline.tally import Tally
    from helixtok.pipeline.tokenizer import inspect_tokenizer
    from helixtok.pipeline.unit import kept
    from helixtok.pipeline.units import plan_units

    cfg = BuildConfig(seq_len=2048, workers=1)
    info = inspect_tokenizer(args.tokenizer)
    files, _ = discover([args.corpus])
    units, _ = plan_units(files, unit_bytes=cfg.unit_bytes, text_field=cfg.text_field)
    info, _ = choose_backend(info, units, cfg)
    raw, _, _ = flat_encoder(info.backend, info.sha256, cfg.special_tokens,
                             hf_tokenizer(info.sha256, cfg.special_tokens))
    enc = Encoder(info, max_piece_chars=cfg.max_piece_chars)
    tmp = tempfile.mkdtemp(prefix="helixtok-ladder-", dir=os.path.dirname(os.path.abspath(args.corpus)))

    def loop(step: int) -> None:
        with open(os.path.join(tmp, "ids"), "wb") as out:
            for u in units:
                reader = UnitReader(u, cfg.text_field, Tally(), long_bytes=cfg.long_doc_bytes)
                batch, size, srcs, sources = [], 0, [], {}

                def flush() -> None:
                    if step == 0:
                        out.write(raw(batch)[0].astype(info.dtype, copy=False).data)
                        return
                    ids, lens = enc.encode(batch)
                    out.write(ids.data)
                    if step >= 2:
                        for src, n, b in zip(srcs, lens.tolist(), map(utf8_len, batch)):
                            c = sources.setdefault(src, [0, 0, 0])
                            c[0] += 1
                            c[1] += n
                            c[2] += b
                for text in reader:
                    if step >= 2:
                        text, s = kept(text, cfg)
                        if s is None:
                            continue
                        srcs.append(reader.source())
                    batch.append(text)
                    size += len(text)
                    if size >= cfg.batch_chars:
                        flush()
                        batch, size, srcs = [], 0, []
                if batch:
                    flush()

    def run_units_alone() -> float:
        spent, real = [0.0], hb.run_units

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                spent[0] = time.perf_counter() - t
        hb.run_units = timed
        try:
            hb.build([args.corpus], os.path.join(tmp, "out"), args.tokenizer, cfg, overwrite=True)
        finally:
            hb.run_units = real
        return spent[0]

    best: dict[int, list[float]] = {}
    try:
        for _ in range(args.repeat):
            for step in args.steps:
                os.sync()
                if step == 3:
                    dt = run_units_alone()
                else:
                    t = time.perf_counter()
                    loop(step)
                    dt = time.perf_counter() - t
                best.setdefault(step, []).append(dt)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = min(best[args.steps[0]])
    print(f"{'step':50} {'best s':>7} {'x first':>8}  all")
    for step in args.steps:
        v = best[step]
        print(f"{NAMES[step]:50} {min(v):7.2f} {min(v) / base:8.2f}  {' '.join(f'{x:.2f}' for x in v)}")


if __name__ == "__main__":
    main()
