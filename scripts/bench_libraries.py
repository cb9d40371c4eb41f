"""Tokenizer libraries side by side: each one's encode rate on the same documents (one process, one
pass: every library caches words, so a second pass measures its cache), and a digest of every
document's ids, so that two environments (e.g. tokenizers 0.x and a 1.0 release candidate, which
cannot be installed together) can be compared with --compare.

    python scripts/bench_libraries.py --tokenizer T.json --corpus DIR [--docs 1500] --json a.json
    other-env/bin/python scripts/bench_libraries.py --tokenizer T.json --corpus DIR --json b.json
    python scripts/bench_libraries.py --compare a.json b.json
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import time

os.environ.setdefault("FASTOKENS_BPE_THREADS", "1")  # one core each, as in a build's workers
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def documents(corpus: str, n: int) -> list[str]:
    """Up to n documents, taken evenly from every .jsonl file of `corpus` (its "text" field)."""
    files = sorted(glob.glob(os.path.join(corpus, "**", "*.jsonl"), recursive=True))
    per = max(1, n // max(1, len(files)))
    docs = []
    for f in files:
        with open(f, encoding="utf-8") as fh:
            for i, line in zip(range(per), fh):
                docs.append(json.loads(line)["text"])
    return docs[:n]


LIBRARIES = ("tokenizers", "fastokens", "splintr")


def encoder(lib: str, path: str):
    """(encode(list[str]) -> the library's own result, that result -> a list of id lists, its name
    with version), or None where `lib` is not installed: only the first is timed."""
    if lib == "tokenizers":
        import tokenizers

        tk = tokenizers.Tokenizer.from_file(path)
        return (lambda docs: [tk.encode(d, add_special_tokens=False) for d in docs],
                lambda encs: [e.ids for e in encs], f"tokenizers {tokenizers.__version__}")
    if lib == "splintr":  # splintr-rs: loads a tokenizer.json; encode_ordinary keeps special-token strings as text
        try:
            import splintr
            from importlib.metadata import version
        except ImportError:
            return None
        st = splintr.from_json(path)
        lead = len(st.encode_ordinary(""))  # what its post-processor puts before every text (Llama 3's BOS)
        return (lambda docs: [st.encode_ordinary(d) for d in docs], lambda encs: [e[lead:] for e in encs],
                f"splintr {version('splintr-rs')}")
    try:
        import fastokens
    except ImportError:
        return None
    with open(path, encoding="utf-8") as fh:
        ft = fastokens.Tokenizer.from_json_str(fh.read())

    def lists(flat):
        import numpy as np

        ids, ends = np.frombuffer(flat[0], dtype="<u4"), np.frombuffer(flat[1], dtype="<u8")
        return [ids[a:b].tolist() for a, b in zip(ends[:-1], ends[1:])]

    return (lambda docs: ft.encode_batch_flat(docs, add_special_tokens=False, split_special_tokens=True), lists,
            "fastokens")


def measure(lib: str, path: str, docs: list[str]):
    """(name, MB/s, digests) of one library, or None: run in a process of its own (forked), so that
    no library's heap or threads left from another's run slow it."""
    got = encoder(lib, path)
    if got is None:
        return None
    encode, lists, name = got
    t = time.perf_counter()
    result = encode(docs)
    dt = time.perf_counter() - t
    mb = sum(len(d.encode()) for d in docs) / 1e6
    return name, mb / dt, [hashlib.sha256(json.dumps(x).encode()).hexdigest()[:16] for x in lists(result)]


def run(args) -> dict:
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    docs = documents(args.corpus, args.docs)
    mb = sum(len(d.encode()) for d in docs) / 1e6
    out = {"documents": len(docs), "MB": round(mb, 2)}
    for lib in LIBRARIES:
        with ProcessPoolExecutor(1, mp_context=mp.get_context("fork")) as ex:
            got = ex.submit(measure, lib, args.tokenizer, docs).result()
        if got is None:
            continue
        name, rate, digests = got
        out[name] = {"MB/s": round(rate, 1), "digests": digests}
        print(f"{name}: {rate:.1f} MB/s on {len(docs)} documents ({mb:.1f} MB)")
    libs = [k for k in out if isinstance(out[k], dict)]
    for other in libs[1:]:
        diff = sum(a != b for a, b in zip(out[libs[0]]["digests"], out[other]["digests"]))
        print(f"{other} vs {libs[0]}: {diff} of {len(docs)} documents' ids differ")
    return out


def compare(a: str, b: str) -> None:
    with open(a) as fa, open(b) as fb:
        x, y = json.load(fa), json.load(fb)
    for p in (k for k in x if isinstance(x[k], dict)):
        for q in (k for k in y if isinstance(y[k], dict)):
            diff = sum(u != v for u, v in zip(x[p]["digests"], y[q]["digests"]))
            print(f"{a}: {p} vs {b}: {q}: {diff} of {len(x[p]['digests'])} documents' ids differ")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer")
    ap.add_argument("--corpus", help="a folder of .jsonl files with a text field")
    ap.add_argument("--docs", type=int, default=1500)
    ap.add_argument("--json", help="write the rates and digests here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = ap.parse_args()
    if args.compare:
        compare(*args.compare)
    else:
        got = run(args)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(got, fh)
