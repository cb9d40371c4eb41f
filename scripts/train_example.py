"""Train a tiny causal LM on a helixtok dataset: exact progress total, LR schedule from `helixtok stats`,
checkpoint + exact mid-epoch resume, and multi-process DDP (gloo on CPU) under torchrun.

    python scripts/train_example.py --data out/                      # one process
    python scripts/train_example.py --data out/ --stop-after 40      # "crash" at step 40 (checkpoint saved)
    python scripts/train_example.py --data out/ --resume             # continue at the exact next sample
    torchrun --nproc_per_node 2 scripts/train_example.py --data out/ # two ranks, gloo
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helixtok import ChunkSampler, MemmapChunkDataset  # noqa: E402
from helixtok.read.stats import stats_for  # noqa: E402


class TinyLM(nn.Module):
    def __init__(self, vocab: int, d: int = 64, layers: int = 2, max_len: int = 2048):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        block = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        # enable_nested_tensor=False: with norm_first torch would only warn that it cannot use it.
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, vocab)

    def forward(self, input_ids, labels, attention_mask):
        L = input_ids.shape[1]
        x = self.emb(input_ids) + self.pos(torch.arange(L))
        causal = torch.triu(torch.full((L, L), float("-inf")), 1)
        logits = self.head(self.blocks(x, mask=causal))
        # The model shifts: predict token t+1 from tokens <= t; -100 labels (padding) are ignored.
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--data", required=True, help="a helixtok dataset folder (helixtok build's OUT)")
    ap.add_argument("--batch-size", type=int, default=16, help="samples per rank per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=2, help="micro-batches per optimizer step")
    ap.add_argument("--epochs", type=int, default=1, help="passes over the train split")
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear warmup, cosine decay)")
    ap.add_argument("--warmup-ratio", type=float, default=0.05, help="share of optimizer steps spent warming up")
    ap.add_argument("--checkpoint", default="/tmp/helixtok-example.pt", help="checkpoint path (one file per rank)")
    ap.add_argument("--stop-after", type=int, default=0, help="save a checkpoint and exit after N optimizer steps")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="stop after N optimizer steps without a checkpoint (0: run every step stats predicts)")
    ap.add_argument("--resume", action="store_true", help="continue from --checkpoint at the exact next sample")
    ap.add_argument("--num-workers", type=int, default=0,
                    help="DataLoader worker processes (0 is fastest for memory-mapped data; see docs/training.md)")
    args = ap.parse_args()

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    ds = MemmapChunkDataset(args.data)
    st = stats_for(args.data, batch_size=args.batch_size, grad_accum=args.grad_accum, world_size=world,
                   epochs=args.epochs, warmup_ratio=args.warmup_ratio)
    import json

    vocab = json.load(open(os.path.join(args.data, "manifest.json")))["tokenizer"]["vocab_size"]
    model = TinyLM(vocab, max_len=ds.seq_len)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    total, warm = st.total_optimizer_steps, st.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / max(1, warm) if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, total - warm))))
    sampler = ChunkSampler(ds, seed=0, rank=rank, world_size=world)
    step, epoch, batch_in_epoch = 0, 0, 0
    if args.resume:
        ck = torch.load(args.checkpoint.replace(".pt", f".rank{rank}.pt"), weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        sampler.load_state_dict(ck["sampler"])
        step, epoch, batch_in_epoch = ck["step"], ck["sampler"]["epoch"], ck["batch_in_epoch"]
        if rank == 0:
            print(f"resumed at step {step}/{total}, epoch {epoch}, batch {batch_in_epoch}; last loss {ck['loss']:.4f}")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

    with Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                  TextColumn("loss {task.fields[loss]}"), disable=rank != 0) as bar:
        task = bar.add_task("train", total=total, completed=step, loss="-")
        loss_v = float("nan")
        for epoch in range(epoch, args.epochs):
            if not (args.resume and epoch == sampler.epoch and batch_in_epoch):
                sampler.set_epoch(epoch)
                batch_in_epoch = 0
            dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers)
            n_batches = batch_in_epoch + len(dl)
            assert n_batches == st.batches_per_epoch, (n_batches, st.batches_per_epoch)
            for batch in dl:
                batch_in_epoch += 1
                loss = model(**batch) / args.grad_accum
                loss.backward()
                loss_v = loss.item() * args.grad_accum
                if batch_in_epoch % args.grad_accum == 0 or batch_in_epoch == n_batches:
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                    step += 1
                    bar.update(task, completed=step, loss=f"{loss_v:.3f}")
                    if step == args.max_steps:
                        print(f"stopped at {step}/{total} optimizer steps (--max-steps)")
                        return
                    if step == args.stop_after:
                        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                                    "sampler": sampler.state_dict(batch_in_epoch * args.batch_size),
                                    "step": step, "batch_in_epoch": batch_in_epoch, "loss": loss_v},
                                   args.checkpoint.replace(".pt", f".rank{rank}.pt"))
                        if rank == 0:
                            print(f"checkpoint at step {step}/{total}; stopping (--stop-after)")
                        return
    if rank == 0:
        print(f"done: {step}/{total} optimizer steps (helixtok stats said {total}), warmup {warm}, "
              f"final loss {loss_v:.4f}")
    assert step == total
    if world > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
