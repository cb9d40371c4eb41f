"""Build throughput beside the peer pipelines, in one run, on the same documents, tokenizer and process count.

Usage: python scripts/bench_peers.py --tokenizer tok.json [--corpus ../shared/corpus/dev] [--workers 1 2]
           [--scale 10] [--datatrove-python VENV/bin/python] [--megatron MEGATRON_LM_CHECKOUT]
           [--megatron-python VENV/bin/python] [--skip-hf] [--repeat 2]

Rows: the limit (one process doing only what cannot be avoided: read, decompress and parse the
inputs, encode with the backend `--backend auto` picks, write the ids once to a file beside the
outputs); the same work split over N processes
started together (what N cores of this machine give); helixtok at N workers (auto and hf);
HF datatrove's DocumentTokenizer (run with the python of a venv where datatrove is installed:
it is not a helixtok dependency); Megatron-LM's tools/preprocess_data.py (HF tokenizers) and
preprocess_data_fast.py (GigaToken) from a checkout passed with --megatron (fetched at bench
time, never vendored).  Every row reports MB/s of text, M tokens/s, peak RSS of all its
processes, its ratio to N x the limit, and its token count next to helixtok's manifest (ids +
one EOS per document in all of them).  helixtok rows also report the CPU seconds of the build's
own process (the coordinator: plan, journal, manifest) beside those of the whole build.  Inputs: the corpus's documents as 16 .jsonl files (so
file-parallel peers get N-way parallelism), repeated --scale times for the scaled rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import resource
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_build import load_docs, run_measured  # noqa: E402  (sibling script)

FILES = 16

# helixtok's command line, writing the CPU seconds of its own process (not its workers) at exit.
COORDINATOR_CPU = r'''
import atexit, resource, sys
path = sys.argv.pop(1)
def spent():
    r = resource.getrusage(resource.RUSAGE_SELF)
    open(path, "w").write(str(r.ru_utime + r.ru_stime))
atexit.register(spent)
from helixtok.cli import main
main(prog_name="helixtok")
'''

DATATROVE = r'''
import sys
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.tokens import DocumentTokenizer
src, tok, out, n, eos = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
if __name__ == "__main__":  # its workers are new processes that import this file
    LocalPipelineExecutor(pipeline=[
        JsonlReader(src, glob_pattern="*.jsonl", doc_progress=False),
        DocumentTokenizer(output_folder=out + "/tok", tokenizer_name_or_path=tok, eos_token=eos,
                          shuffle_documents=False, save_filename="dt"),
    ], tasks=n, workers=n, logging_dir=out + "/logs", skip_completed=False).run()
'''


def limit_seconds(corpus: str, tok: str, part: tuple[int, int] = (0, 1), barrier=None,
                  backend: str | None = None) -> tuple[float, int, str, float]:
    """One process: read + decompress + parse every unit (units[k::n] for part=(k, n)), encode
    with the backend auto picks (or `backend`, already picked: no check), write the ids once (to a
    file in the inputs' folder, the outputs' file system).  With a barrier, timing starts when
    all parts are ready.  Also returns when it ended (time.time())."""
    from helixtok.pipeline.backend_check import choose_backend
    from helixtok.pipeline.backends import flat_encoder, hf_tokenizer
    from helixtok.pipeline.config import BuildConfig
    from helixtok.pipeline.discover import discover
    from helixtok.pipeline.sources import UnitReader
    from helixtok.pipeline.tally import Tally
    from helixtok.pipeline.tokenizer import inspect_tokenizer
    from helixtok.pipeline.units import plan_units

    cfg = BuildConfig()
    info = inspect_tokenizer(tok)
    files, _ = discover([corpus])
    units, _ = plan_units(files, unit_bytes=cfg.unit_bytes, text_field="text")
    info = dataclasses.replace(info, backend=backend) if backend else choose_backend(info, units, cfg)[0]
    encode, _, _ = flat_encoder(info.backend, info.sha256, cfg.special_tokens, hf_tokenizer(info.sha256, cfg.special_tokens))
    if barrier is not None:
        barrier.wait()
    t0 = time.perf_counter()
    n = 0
    ids_path = os.path.join(os.path.dirname(os.path.abspath(corpus)), f"limit-{part[0]}.ids")
    with open(ids_path, "wb") as out:
        for u in units[part[0]::part[1]]:
            batch, size = [], 0
            for text in UnitReader(u, "text", Tally()):
                batch.append(text)
                size += len(text)
                if size >= 1 << 20:
                    ids = encode(batch)[0]
                    out.write(ids.astype(info.dtype, copy=False).data)
                    n += len(ids) + len(batch)
                    batch, size = [], 0
            if batch:
                ids = encode(batch)[0]
                out.write(ids.astype(info.dtype, copy=False).data)
                n += len(ids) + len(batch)
    dt = time.perf_counter() - t0
    os.remove(ids_path)
    return dt, n, info.backend, time.time()


def _limit_part(corpus, tok, k, n, barrier, results, backend) -> None:
    results.put(limit_seconds(corpus, tok, (k, n), barrier, backend))


def parallel_limit_seconds(corpus: str, tok: str, n: int, backend: str | None = None) -> tuple[float, int, str]:
    """The limit's work split over n processes that start together: what this machine's cores
    give for the unavoidable work (shared caches, memory bandwidth, vCPUs that are not cores).
    n = 1 is the limit row itself: a fresh process each time, as every helixtok row is (a
    tokenizer reused from an earlier repeat has its word cache warm: ~0.3 s of ten copies).
    With `backend` (the one the limit row picked), timed whole instead: from starting the n
    processes until the last is done, each importing, loading its own tokenizer and working
    (no barrier, no check): what the limit costs a user, start-up included."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, results = (None if backend else ctx.Barrier(n)), ctx.Queue()
    procs = [ctx.Process(target=_limit_part, args=(corpus, tok, k, n, barrier, results, backend)) for k in range(n)]
    t0 = time.time()
    for p in procs:
        p.start()
    got = [results.get() for _ in procs]
    for p in procs:
        p.join()
    took = max(end for _, _, _, end in got) - t0 if backend else max(t for t, _, _, _ in got)
    return took, sum(c for _, c, _, _ in got), got[0][2]


def write_inputs(docs: list[str], folder: str, scale: int) -> int:
    """The documents as FILES .jsonl files, `scale` times over; returns the text bytes."""
    os.makedirs(folder)
    fhs = [open(os.path.join(folder, f"part-{k:02d}.jsonl"), "w") for k in range(FILES)]
    nbytes = 0
    for r in range(scale):
        for i, d in enumerate(docs):
            fhs[(r * len(docs) + i) * FILES // (scale * len(docs))].write(json.dumps({"text": d}) + "\n")
            nbytes += len(d.encode())
    for fh in fhs:
        fh.close()
    return nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "corpus", "dev"))
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--scale", type=int, default=1, help="repeat the documents this many times")
    ap.add_argument("--datatrove-python", default=None)
    ap.add_argument("--megatron", default=None, help="a Megatron-LM checkout (with tools/ and megatron/)")
    ap.add_argument("--megatron-python", default=sys.executable,
                    help="python of a venv with torch, triton, transformers and gigatoken for Megatron's tools")
    ap.add_argument("--repeat", type=int, default=2, help="runs per row; the best is kept (noisy machines)")
    ap.add_argument("--skip-hf", action="store_true",
                    help="leave out the rows that encode with HF tokenizers (helixtok --backend hf, datatrove, "
                         "Megatron's preprocess_data.py): slow on a large corpus")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="helixtok-peers-")
    try:
        docs = load_docs(args.corpus)
        src = os.path.join(tmp, "in")
        nbytes = write_inputs(docs, src, args.scale)
        one = os.path.join(tmp, "one.jsonl")  # Megatron reads one file (its --workers split the lines)
        with open(one, "wb") as out:
            for p in sorted(glob.glob(os.path.join(src, "*.jsonl"))):
                with open(p, "rb") as fh:
                    shutil.copyfileobj(fh, out)
        from helixtok.format.tokenizer_file import load_tokenizer
        from helixtok.pipeline.tokenizer import inspect_tokenizer

        info = inspect_tokenizer(args.tokenizer)
        eos = load_tokenizer(args.tokenizer).id_to_token(info.eos_id)
        isz = info.dtype.itemsize  # bytes per id in every tool's output (2 below 65,536 ids, else 4)
        tokdir = os.path.join(tmp, "tokdir")  # what transformers' AutoTokenizer loads
        os.makedirs(tokdir)
        shutil.copy(args.tokenizer, os.path.join(tokdir, "tokenizer.json"))
        with open(os.path.join(tokdir, "tokenizer_config.json"), "w") as fh:
            json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}, fh)
        dt_script = os.path.join(tmp, "datatrove_run.py")
        open(dt_script, "w").write(DATATROVE)

        jobs = []  # (name, kind, workers, command builder(out) -> cmd)
        for w in args.workers:
            for backend in ("auto",) + (() if args.skip_hf else ("hf",)):
                jobs.append((f"helixtok build -j {w} --backend {backend}", "helixtok", w,
                             lambda out, w=w, b=backend: [sys.executable, "-c", COORDINATOR_CPU, os.path.join(
                                 out + ".cpu"), "build", src, out, "-t", args.tokenizer, "-L", "2048", "-j", str(w),
                                 "-q", "--backend", b]))
            if args.datatrove_python and not args.skip_hf:
                jobs.append((f"datatrove DocumentTokenizer, {w} tasks", "datatrove", w,
                             lambda out, w=w: [args.datatrove_python, dt_script, src, args.tokenizer, out, str(w), eos]))
            if args.megatron:
                for tool in ("preprocess_data.py", "preprocess_data_fast.py")[1 if args.skip_hf else 0:]:
                    # The HF tool runs --workers processes; the GigaToken one is one process whose
                    # threads (rayon) are held to the same number of cores.
                    extra = ["--workers", str(w)] if tool == "preprocess_data.py" else ["--use-gigatoken"]
                    jobs.append((f"Megatron {tool}, {w} {'proc' if tool == 'preprocess_data.py' else 'threads'}",
                                 "megatron", w,
                                 lambda out, t=tool, e=extra, w=w: [
                                     "env", f"PYTHONPATH={args.megatron}",  # its tools import the checkout's package
                                     f"RAYON_NUM_THREADS={w}",
                                     args.megatron_python, os.path.join(args.megatron, "tools", t), "--input", one,
                                     "--output-prefix", os.path.join(out, "m"), "--tokenizer-type",
                                     "HuggingFaceTokenizer", "--tokenizer-model", tokdir, "--append-eod", *e]))
        best: dict[str, tuple] = {}
        cpus: dict[str, list[tuple[float, float]]] = {}  # helixtok rows: (coordinator, whole build) CPU s
        lim = None
        par: dict[int, tuple[float, int]] = {}
        whole: dict[int, tuple[float, int]] = {}  # the same, timed from the processes' start (their loads included)
        for _ in range(args.repeat):
            os.sync()
            t, n, chosen = parallel_limit_seconds(src, args.tokenizer, 1)
            lim = min(lim or (t, n, chosen), (t, n, chosen))
            for w in args.workers:
                if w > 1:
                    par[w] = min(par.get(w, (float("inf"), 0)), parallel_limit_seconds(src, args.tokenizer, w)[:2])
                whole[w] = min(whole.get(w, (float("inf"), 0)),
                               parallel_limit_seconds(src, args.tokenizer, w, backend=chosen)[:2])
            for name, kind, w, cmd in jobs:
                out = os.path.join(tmp, "out")
                if kind != "helixtok":  # helixtok makes OUT itself
                    os.makedirs(out)
                os.sync()  # no row pays for writing back the inputs or an earlier row's output
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                try:
                    dt, rss, _ = run_measured(cmd(out))
                except SystemExit as e:
                    best.setdefault(name, (None, None, None, str(e).strip().splitlines()[-1][:70]))
                    shutil.rmtree(out, ignore_errors=True)
                    continue
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)  # the whole tree
                if kind == "helixtok":
                    n = json.load(open(os.path.join(out, "manifest.json")))["totals"]["tokens"]
                    coord = float(open(out + ".cpu").read())
                    os.remove(out + ".cpu")
                    cpus.setdefault(name, []).append((coord, cpu))
                elif kind == "datatrove":
                    n = sum(os.path.getsize(p) for p in glob.glob(f"{out}/tok/**/*.ds", recursive=True)) // isz
                else:
                    n = sum(os.path.getsize(p) for p in glob.glob(f"{out}/m*.bin")) // isz
                if name not in best or best[name][0] is None or best[name][0] > dt:
                    best[name] = (dt, rss, n, None)
                shutil.rmtree(out)
        t_lim, n_lim, chosen = lim
        ref = next((best[n][2] for n, k, _, _ in jobs if k == "helixtok" and best[n][2]), None)
        print(f"documents: {len(docs) * args.scale:,} ({nbytes / 1e6:.1f} MB of text, {FILES} .jsonl files); "
              f"tokenizer {os.path.basename(args.tokenizer)}; cores {len(os.sched_getaffinity(0))}; "
              f"best of {args.repeat}")
        print(f"{'row':48} {'s':>7} {'MB/s':>7} {'Mtok/s':>7} {'peak RSS':>9} {'ratio':>6} {'tokens':>12}")
        print(f"{'limit: read+parse+encode, 1 process [' + chosen + ']':48} {t_lim:7.2f} {nbytes / t_lim / 1e6:7.1f} "
              f"{n_lim / t_lim / 1e6:7.2f} {'':>9} {1.0:6.2f} {n_lim:12,}")
        for w, (t, n) in sorted(par.items()):
            print(f"{f'limit split over {w} processes at once':48} {t:7.2f} {nbytes / t / 1e6:7.1f} "
                  f"{n / t / 1e6:7.2f} {'':>9} {nbytes / t / (w * nbytes / t_lim):6.2f} {n:12,}")
        for w, (t, n) in sorted(whole.items()):
            print(f"{f'limit split over {w}, timed whole (loads included)':48} {t:7.2f} {nbytes / t / 1e6:7.1f} "
                  f"{n / t / 1e6:7.2f} {'':>9} {nbytes / t / (w * nbytes / t_lim):6.2f} {n:12,}")
        for name, kind, w, _ in jobs:
            dt, rss, n, err = best[name]
            if err:
                print(f"{name:48} not run: {err}")
                continue
            mark = "" if n == ref else " (differs)"
            print(f"{name:48} {dt:7.2f} {nbytes / dt / 1e6:7.1f} {n / dt / 1e6:7.2f} {rss / 2**20:6.0f} MiB "
                  f"{nbytes / dt / (w * nbytes / t_lim):6.2f} {n:12,}{mark}")
        for name, runs in cpus.items():
            coord, cpu = min(runs, key=lambda r: r[1])
            print(f"{name:48} CPU: coordinator {coord:.2f} s of {cpu:.2f} s for the whole build ({100 * coord / cpu:.1f}%); "
                  f"the rest {cpu - coord:.2f} s = {(cpu - coord) / t_lim:.2f}x the limit row")
        walls = {w: best[name][0] for name, kind, w, _ in jobs if kind == "helixtok" and "auto" in name and best[name][0]}
        for w, dt in sorted(walls.items()):
            if w in whole:
                print(f"helixtok -j {w}: {whole[w][0] / dt:.2f} of the limit split over {w} timed whole"
                      + (f"; wall {dt / walls[1]:.2f}x -j 1's" if 1 in walls and w > 1 else ""))
        print("ratio: MB/s / (N x the limit row); tokens: ids + one EOS per document (helixtok: totals.tokens); "
              "'limit split over N processes': what N of this machine's cores give for the limit's work (timed from "
              "a barrier; 'timed whole': from their start, each importing and loading its tokenizer)")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
