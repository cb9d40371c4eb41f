"""Run a partitioned helixtok build as Ray tasks, then merge: the same partitions as --num-tasks.

    python scripts/ray_build.py CORPUS OUT --tokenizer tok.json --num-tasks 8 [--address auto] [-- build options]

Each task is `helixtok build CORPUS OUT --num-tasks N --task-index K` on a Ray worker (one
task per partition, `--workers` cores each); an interrupted task resumes when rerun. With no
--address it starts a local Ray cluster on this machine (loopback only).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus")
    ap.add_argument("out")
    ap.add_argument("--tokenizer", "-t", required=True)
    ap.add_argument("--num-tasks", type=int, required=True)
    ap.add_argument("--workers", type=int, default=1, help="cores per task")
    ap.add_argument("--address", default=None, help="Ray cluster address [default: start a local one]")
    args, extra = ap.parse_known_args()  # the rest: more `helixtok build` options, passed through
    extra = [a for a in extra if a != "--"]

    import ray

    ray.init(address=args.address, include_dashboard=False, log_to_driver=False)
    corpus, out, tok = (os.path.abspath(p) for p in (args.corpus, args.out, args.tokenizer))

    @ray.remote(num_cpus=args.workers, max_retries=2)  # a retried task resumes its own part
    def build_part(k: int) -> str:
        cmd = [sys.executable, "-m", "helixtok.cli", "build", corpus, out, "-t", tok, "--num-tasks",
               str(args.num_tasks), "--task-index", str(k), "-j", str(args.workers), "-q", *extra]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"task {k}: {p.stderr.strip().splitlines()[-1]}")
        return os.path.join(out, f"part-{k:05d}")

    t0 = time.perf_counter()
    parts = ray.get([build_part.remote(k) for k in range(args.num_tasks)])
    built = time.perf_counter() - t0
    ray.shutdown()
    p = subprocess.run([sys.executable, "-m", "helixtok.cli", "merge", *parts, out, "--json"],
                       capture_output=True, text=True)
    if p.returncode:
        sys.exit(p.stderr.strip())
    print(f"{args.num_tasks} Ray tasks built in {built:.1f} s; merged into {out}")
    print(p.stdout.strip())


if __name__ == "__main__":
    main()
