"""A build's fixed costs and its time at N processes, side by side in one run, and the model they give.

Usage: python scripts/bench_startup.py --tokenizer tokenizer.json --corpus FOLDER [--workers 1 2 16] [--repeat 2]
           [--predict 16 64]

Rows, each a fresh `python` process building into a new folder:
- per-worker start: a pool of N workers started as a build starts it (the fork server loads the
  tokenizer once and forks them), the CPU seconds each worker has used when it is ready, beside
  the same pool with HELIXTOK_FORK=0 (every worker its own interpreter, imports and load);
- first builds (no cached backend verdict: $HELIXTOK_CACHE is a new folder) and rebuilds (the
  verdict cached) at each N: wall seconds, then the three fixed costs -- start -> first unit
  tokenizing (the first bytes a unit reports), last unit -> manifest, and what lies between;
- the model T(N) = F + W / (N * e): F the fixed costs measured at N=1, W the tokenizing between
  them at N=1, e the efficiency measured at the largest N run; its prediction for --predict N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

BUILD = r'''
import json, os, sys, time
t0 = time.monotonic()
from helixtok.pipeline.builder import build
corpus, out, tok, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
first = [None]
last = [None]
def seen(p):
    now = time.monotonic() - t0
    if p.phase == "tokenize" and p.bytes_done and first[0] is None:
        first[0] = now
    if p.phase == "tokenize" and p.units_done == p.units_total:
        last[0] = last[0] or now
    if p.phase == "write":
        last[0] = last[0] or now
m = build(corpus, out, tok, seq_len=2048, workers=n, on_progress=seen)
end = time.monotonic() - t0
c = os.times()
print(json.dumps({"wall": end, "first_bytes": first[0], "last_unit": last[0], "text_bytes": m["totals"]["text_bytes"],
                  "tokens": m["totals"]["tokens"], "cpu": c.user + c.system + c.children_user + c.children_system,
                  "backend": m["tokenizer"]["backend"]}))
'''

POOL = r'''
import json, os, sys, time
from helixtok.pipeline.config import BuildConfig
from helixtok.pipeline.dispatch import UnitPool
tok, n = sys.argv[1], int(sys.argv[2])
data = open(tok, "rb").read()
t0 = time.monotonic()
pool = UnitPool(n, BuildConfig(), "/nonexistent", "bench", data)
while not all(w.ready for w in pool._workers):
    time.sleep(0.005)
ready = time.monotonic() - t0
def cpu(pid):  # seconds on a CPU, to the nanosecond
    return int(open(f"/proc/{pid}/schedstat").read().split()[0]) / 1e9
per = [cpu(w.proc.pid) for w in pool._workers]
server = cpu(pool._server.pid) if pool._server is not None else 0.0
pool.close()
print(json.dumps({"ready": ready, "worker_cpu": per, "server_cpu": server}))
'''


def _run(code: str, *args, env=None) -> dict:
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT, **(env or {})})
    if r.returncode != 0:
        sys.exit(r.stderr[-2000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=2, help="runs per row; the fastest is kept")
    ap.add_argument("--predict", type=int, nargs="+", default=[16, 64])
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="helixtok-bench-startup-")
    print(f"tokenizer {args.tokenizer} ({os.path.getsize(args.tokenizer) / 1e6:.1f} MB), corpus {args.corpus}, "
          f"{len(os.sched_getaffinity(0))} cores")
    n_pool = max(args.workers)
    for fork in ("1", "0"):
        got = min((_run(POOL, args.tokenizer, n_pool, env={"HELIXTOK_FORK": fork}) for _ in range(args.repeat)),
                  key=lambda r: r["ready"])
        what = "fork server" if fork == "1" else "an interpreter each (HELIXTOK_FORK=0)"
        print(f"per-worker start, {n_pool} workers, {what}: all ready after {got['ready']:.2f} s; CPU per worker "
              f"{max(got['worker_cpu']):.3f} s at most (mean {sum(got['worker_cpu']) / n_pool:.3f}), "
              f"the fork server's own {got['server_cpu']:.2f} s")
    rows = {}
    print(f"{'run':<22}{'wall s':>8}{'MB/s':>8}{'start->1st unit':>17}{'tokenizing':>12}{'last->manifest':>16}"
          f"{'CPU s':>8}")
    for first in (True, False):
        for n in args.workers:
            best = None
            for k in range(args.repeat):
                cache = os.path.join(tmp, f"cache-{n}-{k}-{first}") if first else os.path.join(tmp, "warm")
                out = os.path.join(tmp, f"out-{n}-{k}-{first}-{time.monotonic_ns()}")
                r = _run(BUILD, args.corpus, out, args.tokenizer, n, env={"HELIXTOK_CACHE": cache})
                if best is None or r["wall"] < best["wall"]:
                    best = r
            rows[(first, n)] = best
            mid = best["last_unit"] - best["first_bytes"]
            print(f"{('first build' if first else 'rebuild') + f' -j {n}':<22}{best['wall']:>8.2f}"
                  f"{best['text_bytes'] / best['wall'] / 1e6:>8.1f}{best['first_bytes']:>17.2f}{mid:>12.2f}"
                  f"{best['wall'] - best['last_unit']:>16.2f}{best['cpu']:>8.1f}")
    # T(N) = F + W / (N e(N)): F and W from the first build at the fewest processes, e(N) from each
    # N measured (1 at that N by definition); beyond, the largest N's e.
    n0 = min(args.workers)
    one = rows[(True, n0)]
    fixed = one["first_bytes"] + (one["wall"] - one["last_unit"])
    work = (one["last_unit"] - one["first_bytes"]) * n0
    effs = {n: work / (n * max(1e-9, rows[(True, n)]["wall"] - fixed)) for n in args.workers}
    print(f"model (first builds): T(N) = F + W / (N e(N)), F = {fixed:.2f} s (start -> first unit + last unit -> "
          f"manifest at -j {n0}), W = {work:.2f} s of tokenizing, e(N) measured: "
          + ", ".join(f"e({n}) = {e:.2f}" for n, e in sorted(effs.items())))
    top = max(args.workers)
    for n in args.predict:
        print(f"  T({n}) = {fixed + work / (n * effs[top]):.2f} s predicted with e({top}); "
              f"{fixed + work / n:.2f} s with e = 1")
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
