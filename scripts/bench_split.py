"""How one large compressed file splits: the planner's pass, each unit's time alone, and the wall
time that unit plan allows on N cores (the build's unit order over N workers, after the pass).

Usage: python scripts/bench_split.py FILE.jsonl.zst TOKENIZER.json [--cores 1 2 4 8 16]
Each unit is read and tokenized alone, in this process, with the backend `--backend auto` picks;
"whole" is the same file as one unit.  On a machine with fewer cores than a column, that column
is a schedule of measured unit times, not a measured build (run `helixtok build -j N` there).
"""

from __future__ import annotations

import argparse
import heapq
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import helixtok.pipeline.sources as hs  # noqa: E402
import helixtok.pipeline.discover as hd
import helixtok.pipeline.units as hu
from helixtok.pipeline.backend_check import choose_backend  # noqa: E402
from helixtok.pipeline.backends import flat_encoder  # noqa: E402
from helixtok.pipeline.config import BuildConfig  # noqa: E402
from helixtok.pipeline.dispatch import schedule  # noqa: E402
from helixtok.pipeline.tokenizer import inspect_tokenizer  # noqa: E402


def unit_seconds(unit: hu.Unit, encode, batch_chars: int) -> float:
    t0 = time.perf_counter()
    batch, chars = [], 0
    for text in hs.UnitReader(unit, "text", hs.Tally()):
        batch.append(text)
        chars += len(text)
        if chars >= batch_chars:
            encode(batch)
            batch, chars = [], 0
    if batch:
        encode(batch)
    return time.perf_counter() - t0


def makespan(units: list[hu.Unit], times: list[float], cores: int, unit_bytes: int) -> float:
    """Wall time of the units on `cores` workers, each taking the next unit in the build's order
    when it is free."""
    free = [0.0] * cores
    for u in schedule(units, unit_bytes):
        heapq.heappush(free, heapq.heappop(free) + times[u.index])
    return max(free)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("tokenizer")
    ap.add_argument("--cores", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = ap.parse_args()
    os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")
    config = BuildConfig()
    files, _ = hd.discover([args.file])
    t0 = time.perf_counter()
    units, _ = hu.plan_units(files, unit_bytes=config.unit_bytes, text_field="text")
    plan = time.perf_counter() - t0
    info, check = choose_backend(inspect_tokenizer(args.tokenizer), units, config)
    encode = flat_encoder(info.backend, info.sha256, info.special_tokens, None)[0]
    whole = hu.Unit(0, files[0].kind, (files[0].path,), (files[0].name,))
    base = unit_seconds(whole, encode, config.batch_chars)
    times = [unit_seconds(u, encode, config.batch_chars) for u in units]
    mb = files[0].size / 1e6
    print(f"{files[0].name}: {mb:.0f} MB compressed, {len(units)} units, backend {info.backend}; "
          f"planner pass {plan:.2f} s; whole file {base:.2f} s; units {sum(times):.2f} s in all "
          f"(+{sum(times) / base - 1:.0%} CPU), longest {max(times):.2f} s")
    print(f"{'cores':>5} {'whole file':>10} {'split':>8} {'speed-up':>8}")
    for n in args.cores:
        split = plan + makespan(units, times, n, config.unit_bytes)
        print(f"{n:5d} {base:9.2f}s {split:7.2f}s {base / split:7.2f}x")


if __name__ == "__main__":
    main()
