"""The seed's problem, measured: does the data keep a training step fed?  A GPT-2-small-shaped decoder
(~124M parameters with a 50k vocabulary; bf16 autocast on CUDA) trains a fixed number of steps fed
by, side by side in one run:

  synthetic    random ids made on the device once (the ceiling: no data loading at all)
  helixtok     MemmapChunkDataset + ChunkSampler, DataLoader(num_workers=0, collate_fn=ds.collate)
  on-the-fly   an IterableDataset that reads the corpus's JSON lines and tokenizes them with
               tokenizers as it goes (packed into seq_len chunks), with 0 and --otf-workers workers

Each row prints tokens/s over the timed steps (after --warmup steps), its ratio to the synthetic
row, and the share of the time the loop spent making its next batch.

    helixtok build corpus/ out/ -t tokenizer.json -L 1024
    python scripts/bench_train.py --data out/ --corpus corpus/ --tokenizer tokenizer.json \\
        [--steps 60] [--batch-size 32] [--compile] [--otf-workers 4]
    python scripts/bench_train.py --data out/ --corpus corpus/ --tokenizer tokenizer.json --tiny \
        --steps 3 --warmup 1 --batch-size 2   # the script runs (CPU; its rates say nothing: the model is the bottleneck)
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helixtok import ChunkSampler, MemmapChunkDataset  # noqa: E402


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, D)
        x = x + self.proj(a)
        return x + self.mlp(self.ln2(x))


class Decoder(nn.Module):
    """GPT-2 small's shape by default (12 layers, 768 wide, 12 heads)."""

    def __init__(self, vocab: int, seq_len: int, d: int = 768, layers: int = 12, heads: int = 12):
        super().__init__()
        self.emb, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


class OnTheFly(IterableDataset):
    """What helixtok replaces: JSON lines read and tokenized as training goes, packed into chunks
    (each DataLoader worker takes every k-th file)."""

    def __init__(self, corpus: str, tokenizer: str, seq_len: int, eos: int):
        self.files = sorted(glob.glob(os.path.join(corpus, "**", "*.jsonl"), recursive=True))
        if not self.files:
            raise SystemExit(f"{corpus}: no .jsonl files for the on-the-fly rows")
        self.tokenizer, self.L, self.eos = tokenizer, seq_len, eos

    def __iter__(self):
        from tokenizers import Tokenizer

        info = torch.utils.data.get_worker_info()
        k, n = (info.id, info.num_workers) if info else (0, 1)
        tok = Tokenizer.from_file(self.tokenizer)
        buf: list[int] = []
        for path in itertools.cycle(self.files[k::n] or self.files):
            with open(path, encoding="utf-8") as fh:
                for lines in iter(lambda: list(itertools.islice(fh, 64)), []):
                    for enc in tok.encode_batch([json.loads(x)["text"] for x in lines], add_special_tokens=False):
                        buf += enc.ids + [self.eos]
                    while len(buf) >= self.L:
                        yield torch.tensor(buf[:self.L])
                        del buf[:self.L]


def timed(name: str, model, opt, batches, steps: int, warmup: int, device: str, ceiling: float | None) -> float:
    """Train `steps` steps from `batches` (an iterator of LongTensor [B, L]); tokens/s over the steps after
    `warmup` (the GPU's queue drained at both ends), and the share of that time the loop spent in
    next(batches): making the data.  On a GPU that time overlaps the steps already queued, so it
    costs throughput only where the ratio to the synthetic row drops."""
    auto = torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    waited, tokens, t0 = 0.0, 0, None
    for step in range(warmup + steps):
        if step == warmup:
            sync()
            t0, waited, tokens = time.perf_counter(), 0.0, 0
        w = time.perf_counter()
        batch = next(batches)
        waited += time.perf_counter() - w
        ids = batch.to(device, non_blocking=True)
        with auto:
            logits = model(ids)
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += ids.numel()
    sync()
    dt = time.perf_counter() - t0
    rate = tokens / dt
    ratio = f"{rate / ceiling:6.3f}" if ceiling else "  1.000"
    print(f"{name:<32} {rate:>12,.0f} tok/s  {ratio}  in next() {waited / dt:6.1%}", flush=True)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True, help="a helixtok dataset (packed)")
    ap.add_argument("--corpus", required=True, help="its corpus as .jsonl files (the on-the-fly rows read them)")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--otf-workers", type=int, default=4, help="DataLoader workers of the second on-the-fly row")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer, 64-wide model on the CPU: checks the script runs")
    args = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    ds = MemmapChunkDataset(args.data, fields=("input_ids",))
    L, B = ds.seq_len, args.batch_size
    torch.manual_seed(0)
    shape = dict(d=64, layers=2, heads=4) if args.tiny else {}
    model = Decoder(ds.vocab_size, L, **shape).to(device)
    print(f"device {device}; model {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters; "
          f"seq_len {L}, batch {B}; {args.steps} timed steps after {args.warmup}", flush=True)
    if args.compile:
        model = torch.compile(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")

    def loader(dataset, **kw):
        return iter(DataLoader(dataset, batch_size=B, pin_memory=device == "cuda", **kw))

    synthetic = torch.randint(0, ds.vocab_size, (B, L), device=device)
    ceiling = timed("synthetic (on the device)", model, opt, itertools.repeat(synthetic), args.steps, args.warmup,
                    device, None)
    sampler = ChunkSampler(ds, seed=0)

    def helixtok_batches():
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            for b in DataLoader(ds, batch_size=B, sampler=sampler, collate_fn=ds.collate,
                                pin_memory=device == "cuda", drop_last=True):
                yield b["input_ids"]

    timed("helixtok, num_workers=0", model, opt, helixtok_batches(), args.steps, args.warmup, device, ceiling)
    otf = OnTheFly(args.corpus, args.tokenizer, L, ds.eos_id)
    for n in (0, args.otf_workers):
        kw = dict(num_workers=n, persistent_workers=n > 0, prefetch_factor=4 if n else None)
        timed(f"on-the-fly, num_workers={n}", model, opt, loader(otf, **kw), args.steps, args.warmup, device, ceiling)


if __name__ == "__main__":
    main()
