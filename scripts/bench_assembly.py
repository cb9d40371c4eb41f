"""The assembly's ceiling: how fast a build's one assembling process turns finished units into shards.

Usage: python scripts/bench_assembly.py --tokenizer tok.json [--corpus ../shared/corpus/dev] [--seq-len 2048]
                                        [--packing packed|document] [--repeat 3]

However many workers tokenize, one process packs their spill files into shards in unit order
(copy, sha256, write).  This script tokenizes the corpus once into spill files, exactly as a
worker does, then times the assembly alone over them (--repeat times, the best kept, each on
fresh hard links of the spill files: the assembly deletes the ones it has used).  It prints the
assembly's speed in MB/s of the text those tokens came from, next to one process's tokenizing
speed on the same units: their ratio is how many workers the assembly can keep up with before
it, not the tokenizer, bounds the build.
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

DEV = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "corpus", "dev")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=DEV)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--packing", default="packed", choices=["packed", "document"])
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    from helixtok.assemble import Assembler
    from helixtok.backend_check import choose_backend
    from helixtok.unit import _W, _init_worker, run_unit
    from helixtok.config import BuildConfig
    from helixtok.sources import discover, plan_units
    from helixtok.tokenizer import inspect_tokenizer

    cfg = BuildConfig(seq_len=args.seq_len, packing=args.packing)
    files, _ = discover([args.corpus])
    units, _ = plan_units(files, unit_bytes=cfg.unit_bytes, text_field=cfg.text_field)
    info, _ = choose_backend(inspect_tokenizer(args.tokenizer), units, cfg)
    work = tempfile.mkdtemp(prefix="helixtok-bench-asm-")
    try:
        spill = os.path.join(work, "spill")
        os.makedirs(spill)
        # A worker's own code path (build.run_unit), its spill files kept on disk as a pool's are.
        _init_worker(cfg, spill, "rbench", None, None)
        _W["spool"] = 0
        t0 = time.perf_counter()
        results = [run_unit(u, info) for u in units]
        t_tok = time.perf_counter() - t0
        text = sum(sum(r["text_bytes"].values()) for r in results)
        tokens = sum(sum(r["tokens"].values()) for r in results)
        best = float("inf")
        for _ in range(args.repeat):
            state = os.path.join(work, "state")
            os.makedirs(state)
            for n in os.listdir(spill):
                if not n.endswith(".json"):
                    os.link(os.path.join(spill, n), os.path.join(state, n))
            asm = os.path.join(state, "assembly")
            os.makedirs(asm)
            os.sync()
            t0 = time.perf_counter()
            a = Assembler(asm, info, cfg, state, [u.index for u in units])
            for r in results:
                a.add(dict(r))
            a.finish()
            best = min(best, time.perf_counter() - t0)
            shutil.rmtree(state)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"corpus {args.corpus}: {text / 1e6:.1f} MB of text, {tokens / 1e6:.1f} M tokens ({info.dtype.name}), "
          f"backend {info.backend}, {len(units)} units, cores {len(os.sched_getaffinity(0))}")
    print(f"{'one process tokenizing (worker code path)':<44} {t_tok:7.2f} s {text / t_tok / 1e6:8.1f} MB/s")
    print(f"{'assembly alone (best of ' + str(args.repeat) + ')':<44} {best:7.2f} s {text / best / 1e6:8.1f} MB/s"
          f"   {tokens * info.dtype.itemsize / best / 1e9:.2f} GB/s of tokens")
    print(f"the assembly keeps up with {t_tok / best:.1f} tokenizing processes")


if __name__ == "__main__":
    main()
