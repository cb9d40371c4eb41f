"""Peak memory of a build's whole process tree, the way a user runs it.

Runs `helixtok build CORPUS OUT -t TOKENIZER [extra options]` once per corpus and samples every
process of the tree (the build, its fork server, its workers) every 20 ms: the peak of the sum of
their RSS (pages two processes share are counted twice: an upper bound) and of their PSS (shared
pages split between them). Prints one row per corpus with the input's largest line for scale.

  python scripts/bench_memory.py -t tokenizer.json huge_jsonl/ huge_txt/ huge_gz/ -- -L 2048
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

import psutil


def largest_line(path: str) -> int:
    """The largest line (uncompressed bytes) of the files under path."""
    import gzip

    best = 0
    files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
    for f in files:
        opener = gzip.open if f.endswith(".gz") else open
        with opener(f, "rb") as fh:
            n = 0
            while block := fh.read(1 << 24):
                parts = block.split(b"\n")
                for p in parts[:-1]:
                    best, n = max(best, n + len(p)), 0
                n += len(parts[-1])
            best = max(best, n)
    return best


def peak_tree(cmd: list[str], every: float = 0.02, pss: bool = True) -> tuple[int, int, float, int]:
    """(peak sum RSS, peak sum PSS, seconds, exit status) of cmd's whole process tree."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root = psutil.Process(p.pid)
    peak_rss = peak_pss = 0
    while p.poll() is None:
        rss = pss_sum = 0
        try:
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            break
        for q in procs:
            try:
                if pss:
                    m = q.memory_full_info()
                    rss, pss_sum = rss + m.rss, pss_sum + m.pss
                else:
                    rss += q.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        peak_rss, peak_pss = max(peak_rss, rss), max(peak_pss, pss_sum)
        time.sleep(every)
    err = p.stderr.read().decode(errors="replace")
    if p.wait() != 0:
        sys.stderr.write(err)
    return peak_rss, peak_pss, time.perf_counter() - t0, p.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpora", nargs="+")
    ap.add_argument("-t", "--tokenizer", required=True)
    ap.add_argument("--helixtok", default=shutil.which("helixtok") or "helixtok")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = ap.parse_args(argv[:cut]), argv[cut + 1:]
    print(f"{'corpus':<28} {'largest line':>13} {'peak RSS sum':>13} {'peak PSS sum':>13} "
          f"{'PSS / line':>10} {'seconds':>8}")
    for c in args.corpora:
        line = largest_line(c)
        with tempfile.TemporaryDirectory() as tmp:
            rss, pss, secs, rc = peak_tree([args.helixtok, "build", c, os.path.join(tmp, "out"),
                                            "-t", args.tokenizer, *extra])
        mb = 1 << 20
        print(f"{os.path.basename(c.rstrip('/')):<28} {line / mb:>10.1f} MB {rss / mb:>10.0f} MB {pss / mb:>10.0f} MB "
              f"{pss / max(line, 1):>10.2f} {secs:>8.1f}" + ("" if rc == 0 else f"  (exit {rc})"))


if __name__ == "__main__":
    main()
