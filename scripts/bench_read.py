"""Read throughput side by side: the memmap limit, MemmapChunkDataset through DataLoader, an on-the-fly
tokenizing dataset; and start-up on a synthetic 1.5 B-token dataset.

Usage: python scripts/bench_read.py [--dataset OUT] [--seq-len 512] [--batch-size 16] [--shard-size 1GiB]
                                    [--startup-tokens 1.5e9] [--seconds 3] [--rounds 20] [--remote]
Without --dataset it builds one from ../shared/corpus/dev (one shard at the default --shard-size;
a 1.5 B-token corpus has three 1 GiB shards, so a random batch reads from several: --shard-size 12MB
gives the dev corpus four).  The ratio column is against the raw
limit (numpy fancy-indexing of the same rows from the memmap into an int64 tensor); every row is
measured in slices taken in turn with the others (--rounds), and reports its median slice and the
median of its slice-by-slice ratios (a drifting machine moves both slices of a round together).

--remote adds the object-storage rows: the dataset pushed to moto's S3 server on loopback, read
with ChunkSampler(shuffle="block") through a warm node-local cache beside the local memmap in the
same order (ratio: remote / local), then from a cold cache through a proxy adding 50 ms to every
request: time to the first batch, and tokens/s over the epoch with the GETs and bytes it took.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helixtok import MemmapChunkDataset  # noqa: E402

DEV = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "corpus", "dev")


def raw_batches(ds: MemmapChunkDataset, B: int):
    """The raw limit: numpy fancy-indexing of shuffled rows into an int64 tensor, from one memmap
    holding the split's chunks back to back (written once to a temp file: the layout a reader
    would want, whatever the build's shards are)."""
    import tempfile

    from helixtok.read.splitview import SplitView

    view = SplitView(ds.path, ds.manifest, ds.split)
    path = os.path.join(tempfile.mkdtemp(prefix="bench-read-"), "chunks.bin")
    if ds.packing == "bestfit":  # chunks gathered from the index's pieces, padded
        np.stack([view.chunk(i) for i in range(len(ds))]).tofile(path)
    else:
        view.tokens(0, len(ds) * ds.seq_len).tofile(path)
    mm = np.memmap(path, dtype=ds.dtype, mode="r").reshape(-1, ds.seq_len)
    os.remove(path)  # the map keeps it
    rng = np.random.default_rng(0)
    while True:
        for idx in np.array_split(rng.permutation(len(ds)), max(1, len(ds) // B)):
            yield torch.from_numpy(mm[idx].astype(np.int64))


def loader_batches(ds, B: int, workers: int, collate_fn=None):
    """Batches of a shuffled DataLoader over ds, epoch after epoch (workers started once)."""
    dl = DataLoader(ds, batch_size=B, shuffle=True, num_workers=workers, persistent_workers=workers > 0,
                    collate_fn=collate_fn)
    while True:
        for b in dl:
            yield b["input_ids"]


class Row:
    """One row of the table, measured in short slices taken in turn with the other rows: on a
    machine whose speed drifts (shared vCPUs), rows measured minutes apart are not comparable,
    slices taken side by side are, and the median slice ignores a stall."""

    def __init__(self, name: str, batches):
        self.name, self.batches, self.rates = name, batches, []
        next(self.batches)  # start-up is not throughput

    def slice(self, seconds: float) -> None:
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            n += next(self.batches).numel()
        self.rates.append(n / (time.perf_counter() - t0))

    @property
    def rate(self) -> float:
        return float(np.median(self.rates))


class OnTheFly(IterableDataset):
    """The pattern that starved the GPU: tokenize documents while training, pack into seq_len."""

    def __init__(self, docs, tok_path, L):
        self.docs, self.tok_path, self.L = docs, tok_path, L

    def __iter__(self):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(self.tok_path)
        eos = tok.token_to_id("<|endoftext|>")
        buf = []
        for d in self.docs:
            buf.extend(tok.encode(d).ids + [eos])
            while len(buf) >= self.L:
                x = torch.tensor(buf[: self.L])
                buf = buf[self.L:]
                yield {"input_ids": x, "labels": x.clone(), "attention_mask": torch.ones_like(x)}


class _Prepared(torch.utils.data.Dataset):
    """A dataset whose every batch is the same prepared one: what the DataLoader costs by itself."""

    def __init__(self, batch, n: int):
        self.batch, self.n = batch, n

    def __len__(self) -> int:
        return self.n

    def __getitems__(self, indices):
        return self.batch


def synthetic(path: str, tokens: float, L: int) -> None:
    n = int(tokens) // L
    per = (1 << 30) // (L * 2)
    shards, i = [], 0
    os.makedirs(path)
    while i < n:
        k = min(per, n - i)
        p = os.path.join(path, f"train-{len(shards):05d}.bin")
        mm = np.memmap(p, dtype="<u2", mode="w+", shape=(k * L,))
        mm[:] = np.arange(k * L, dtype=np.uint64) % 50000
        mm.flush()
        del mm
        fake = "0" * 64  # not verified by the reader (`helixtok verify` would refuse this dataset)
        shards.append({"path": os.path.basename(p), "bytes": k * L * 2, "sha256": fake, "num_chunks": k,
                       "docs": {"path": f"train-{len(shards):05d}.docs", "sha256": fake, "count": 0}})
        open(os.path.join(path, shards[-1]["docs"]["path"]), "wb").close()
        i += k
    m = {"format_version": 1, "dtype": "uint16", "seq_len": L, "packing": "packed",
         "tokenizer": {"sha256": "0" * 64, "vocab_size": 50000, "eos_id": 0, "pad_id": 0, "file": "tokenizer.json"},
         "splits": {"train": {"num_chunks": n, "num_tokens": n * L, "pad_tokens": 0, "dropped_tokens": 0,
                              "tokens": n * L, "documents": 0, "dropped_documents": 0, "shards": shards}},
         "totals": {"documents": 0, "tokens": n * L, "chunks": n}}
    json.dump(m, open(os.path.join(path, "manifest.json"), "w"))


def sampled_batches(ds, B: int, window: int = 8):
    """Batches in block-shuffle order (ChunkSampler), epoch after epoch."""
    from helixtok import ChunkSampler

    s = ChunkSampler(ds, seed=0, shuffle="block", window=window)
    epoch = 0
    while True:
        s.set_epoch(epoch)
        for b in DataLoader(ds, batch_size=B, sampler=s, collate_fn=ds.collate):
            yield b["input_ids"]
        epoch += 1


def remote_rows(out: str, B: int, args, tmp: str) -> None:
    """The object-storage rows (see the module's docstring)."""
    import json as _json

    sys.path.insert(0, os.path.dirname(__file__))
    from s3_loopback import LatencyProxy, start_moto

    log = open(os.path.join(tmp, "moto.log"), "w")
    proc, url = start_moto(log)
    env = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    try:
        _make_bucket(url, env)
        subprocess.run([sys.executable, "-m", "helixtok.cli", "push", out, "s3://bench/data"], check=True,
                       env={**os.environ, **env, "AWS_ENDPOINT_URL": url}, capture_output=True)
        # Warm: a cache that holds the dataset, filled by one epoch; then read beside the local memmap.
        os.environ.update({**env, "AWS_ENDPOINT_URL": url})
        local = MemmapChunkDataset(out, block_bytes=args.block_bytes)
        warm = MemmapChunkDataset("s3://bench/data", cache_dir=os.path.join(tmp, "warm"), block_bytes=args.block_bytes)
        for _ in zip(range(len(warm) // B + 1), sampled_batches(warm, B)):
            pass
        rows = [Row("local memmap, ChunkSampler(shuffle='block'), workers 0", sampled_batches(local, B)),
                Row("s3:// through a warm cache, same order", sampled_batches(warm, B))]
        for _ in range(args.rounds):
            for r in rows:
                r.slice(args.seconds / args.rounds)
        ratio = float(np.median([a / b for a, b in zip(rows[1].rates, rows[0].rates)]))
        print(f"{rows[0].name:66} {rows[0].rate / 1e6:9.2f}")
        print(f"{rows[1].name:66} {rows[1].rate / 1e6:9.2f} {ratio:6.2f}  (ratio: remote / local)")
        # Cold, through 50 ms a request: a child process (its s3fs talks to the proxy).
        proxy = LatencyProxy(url, 0.05)
        code = ("import json, sys, time\n"
                "sys.path.insert(0, sys.argv[1])\n"
                "import bench_read as b\n"
                "from helixtok import MemmapChunkDataset\n"
                "t = time.perf_counter()\n"
                "ds = MemmapChunkDataset('s3://bench/data', cache_dir=sys.argv[2], block_bytes=sys.argv[3])\n"
                "it = b.sampled_batches(ds, int(sys.argv[4]))\n"
                "n = next(it).numel(); first = time.perf_counter() - t\n"
                "for _ in range(len(ds) // int(sys.argv[4]) - 1): n += next(it).numel()\n"
                "print(json.dumps({'first': first, 'secs': time.perf_counter() - t, 'tokens': n, **ds.cache_counts}))\n")
        res = subprocess.run([sys.executable, "-c", code, os.path.dirname(__file__), os.path.join(tmp, "cold"),
                              str(args.block_bytes), str(B)], check=True, capture_output=True, text=True,
                             env={**os.environ, **env, "AWS_ENDPOINT_URL": proxy.url})
        got = _json.loads(res.stdout.strip().splitlines()[-1])
        data = sum(e["bytes"] for e in local.manifest["splits"]["train"]["shards"])
        print(f"s3:// cold cache, +50 ms a request: first batch {got['first'] * 1e3:.0f} ms (opening included), "
              f"one epoch {got['tokens'] / got['secs'] / 1e6:.2f} Mtok/s, {got['gets']} GETs, "
              f"{got['bytes_fetched'] / data:.3f}x the data fetched")
        proxy.close()
        plan_rows(os.path.join(tmp, "plan"), args)
    finally:
        proc.terminate()
        log.close()


def plan_rows(cache: str, args) -> None:
    """Block shuffle over a cache of fetch_plan's cache_needed: node 0 of two (two ranks each, step
    by step), what it fetched against what fetch_plan said, for block sizes down to 4 MiB."""
    import itertools

    from helixtok import ChunkSampler
    from helixtok.read.sizes import parse_bytes

    for block in ("64MiB", "16MiB", "4MiB"):
        b = parse_bytes(block)
        ds = MemmapChunkDataset("s3://bench/data", cache_dir=os.path.join(cache, block), block_bytes=b,
                                cache_limit=8 * 2 * b)
        kw = dict(shuffle="block", window=2, world_size=4, ranks_per_node=2)
        plan = ds.fetch_plan(**kw)
        for i in itertools.chain.from_iterable(zip(*(ChunkSampler(ds, seed=0, rank=r, **kw) for r in (0, 1)))):
            ds[i]
        c = ds.cache_counts
        segs = [n for e in ds.manifest["splits"]["train"]["shards"] for n, _ in e["segments"]]
        print(f"block shuffle, blocks {block}, cache {8 * 2 * b >> 20} MiB, node 0 of 2: fetched "
              f"{c['bytes_fetched'] / 1e6:.1f} MB in {c['gets']} GETs; fetch_plan {plan['bytes'] / 1e6:.1f} MB in "
              f"{plan['gets']} GETs: {c['bytes_fetched'] / plan['bytes']:.3f}x (largest segment "
              f"{max(segs) / 1e6:.2f} MB)")


def _make_bucket(url: str, env: dict) -> None:
    import s3fs

    os.environ.update({**env, "AWS_ENDPOINT_URL": url})
    s3fs.S3FileSystem(skip_instance_cache=True).mkdir("bench")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--shard-size", default="1GiB")
    ap.add_argument("--seconds", type=float, default=3.0, help="per row, in --rounds slices")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--startup-tokens", type=float, default=1.5e9)
    ap.add_argument("--remote", action="store_true", help="also the object-storage rows (moto on loopback)")
    ap.add_argument("--block-bytes", default="64MiB", help="--remote: MemmapChunkDataset's block_bytes")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="helixtok-read-")
    try:
        L, B = args.seq_len, args.batch_size
        out = args.dataset
        tok = None
        if out is None:
            from helixtok.pipeline.tokenizer import train_tokenizer

            tok = os.path.join(tmp, "tok.json")
            txt = os.path.join(DEV, "txt")
            train_tokenizer((open(os.path.join(txt, f)).read() for f in sorted(os.listdir(txt))), tok, vocab_size=16384)
            out = os.path.join(tmp, "out")
            subprocess.run([sys.executable, "-m", "helixtok.cli", "build", DEV, out, "-t", tok, "-L", str(L), "-q",
                            "--shard-size", args.shard_size],
                           check=True)
        ds = MemmapChunkDataset(out)
        ids_only = MemmapChunkDataset(out, fields=("input_ids",) if ds.packing == "packed" else ("input_ids", "labels"))
        batch = ds.__getitems__(list(range(min(B, len(ds)))))
        rows = [Row("raw limit: numpy fancy index from memmap -> int64 tensor", raw_batches(ds, B)),
                Row(f"MemmapChunkDataset, DataLoader(batch {B}, shuffle, workers 0)", loader_batches(ds, B, 0)),
                Row("  same, collate_fn=ds.collate (no re-stacking), workers 0", loader_batches(ds, B, 0, ds.collate)),
                Row(f"  same, fields={ids_only.fields}, workers 0", loader_batches(ids_only, B, 0, ds.collate)),
                Row("  DataLoader's own floor: __getitems__ hands back one prepared batch",
                    loader_batches(_Prepared(batch, len(ds)), B, 0, ds.collate))]
        if ds.packing != "document":  # a new packing each epoch: chunks gathered from pieces
            rows.append(Row("  same, repack=True (this epoch's packing), workers 0",
                            loader_batches(MemmapChunkDataset(out, repack=True), B, 0, ds.collate)))
        for _ in range(args.rounds):
            for r in rows:
                r.slice(args.seconds / args.rounds)
        # Worker processes prefetch behind the other rows' backs: each of these runs alone, in one piece.
        for collate in (None, ds.collate):
            name = ("  same, collate_fn=ds.collate, workers 2 (measured alone)" if collate else
                    f"MemmapChunkDataset, DataLoader(batch {B}, shuffle, workers 2) (alone)")
            rows.append(Row(name, loader_batches(ds, B, 2, collate)))
            rows[-1].slice(args.seconds)
            rows[-1].batches.close()  # ends its worker processes
        limit = rows[0].rate
        # A row's ratio: the median over rounds of its slice against the raw limit's slice of that round.
        table = [(r.name, r.rate, f"{min(r.rates) / 1e6:.0f}-{max(r.rates) / 1e6:.0f}",
                  float(np.median([a / b for a, b in zip(r.rates, rows[0].rates)])) if len(r.rates) > 1 else
                  r.rate / limit) for r in rows]
        if tok:
            from bench_build import load_docs

            docs = load_docs(DEV)
            dl = DataLoader(OnTheFly(docs, tok, L), batch_size=B)
            n, t0 = 0, time.perf_counter()
            for b in dl:
                n += b["input_ids"].numel()
                if time.perf_counter() - t0 > args.seconds:
                    break
            rate = n / (time.perf_counter() - t0)
            table.append(("baseline: on-the-fly tokenizing IterableDataset, workers 0", rate, "", rate / limit))
        print(f"dataset: {out} ({len(ds)} chunks x {L} in {len(ds._shards)} shards), cores: {len(os.sched_getaffinity(0))}; "
              f"{args.rounds} slices of {args.seconds / args.rounds:.2f} s per row, taken in turn")
        print(f"{'row':66} {'Mtok/s':>9} {'ratio':>6} {'slices':>10}")
        for name, r, spread, ratio in table:
            print(f"{name:66} {r / 1e6:9.2f} {ratio:6.2f} {spread:>10}")
        print("Mtok/s: median slice; ratio: median over rounds of the row's slice / the raw limit's slice of the "
              "same round (rows measured alone: to the raw limit's median); slices: min-max Mtok/s")
        print("(a training run of the HelixLM kind consumes ~0.029 Mtok/s)")
        if args.remote:
            remote_rows(out, B, args, tmp)

        syn = os.path.join(tmp, "syn")
        t = time.perf_counter()
        synthetic(syn, args.startup_tokens, L)
        made = time.perf_counter() - t
        subprocess.run(["sync"])
        from helixtok import ChunkSampler

        t0 = time.perf_counter()
        ds = MemmapChunkDataset(syn)
        n = len(ds)
        batch = next(iter(DataLoader(ds, batch_size=B, sampler=ChunkSampler(ds, seed=0), collate_fn=ds.collate)))
        startup = time.perf_counter() - t0
        t0 = time.perf_counter()
        ds2 = MemmapChunkDataset(syn)
        next(iter(DataLoader(ds2, batch_size=B, shuffle=True)))
        startup_rs = time.perf_counter() - t0
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "helixtok.cli", "stats", syn, "-b", str(B), "--json"], check=True,
                       capture_output=True)
        st = time.perf_counter() - t0
        gb = sum(os.path.getsize(os.path.join(syn, f)) for f in os.listdir(syn)) / 1e9
        print(f"start-up, synthetic {n * L / 1e9:.2f} B tokens ({gb:.1f} GB, made in {made:.0f} s): "
              f"construct + len + first batch {startup * 1e3:.0f} ms with ChunkSampler "
              f"({startup_rs * 1e3:.0f} ms with DataLoader(shuffle=True): torch's randperm of every index); "
              f"`helixtok stats` process {st * 1e3:.0f} ms"
              f" (batch {tuple(batch['input_ids'].shape)})")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
