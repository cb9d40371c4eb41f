"""PyTorch Lightning on a helixtok dataset: ChunkSampler instead of Lightning's DistributedSampler, exact resume.

Usage: python scripts/recipe_lightning.py OUT [--batch-size 8] [--grad-accum 2] [--epochs 1]
                                          [--stop-after N --ckpt PATH] [--resume PATH]
Trains a tiny causal LM on CPU; prints the optimizer steps Lightning ran and what `helixtok stats`
predicted. --stop-after N saves a checkpoint after N optimizer steps and exits; --resume continues
from it at exactly the next sample (the sampler's state rides in the checkpoint).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from helixtok import ChunkSampler, MemmapChunkDataset  # noqa: E402
from helixtok.read.stats import stats_for  # noqa: E402

# On a mid-epoch resume Lightning warns that "your dataloader is not resumable": it looks for
# state_dict() on the DataLoader itself and cannot see that the sampler's position rides in the
# DataModule's state (Data.state_dict below), which makes the resume exact (tests/test_docs.py
# checks every sample against an uninterrupted run). Silenced for that reason alone.
warnings.filterwarnings("ignore", message=".*dataloader is not resumable.*")


class TinyLM(L.LightningModule):
    def __init__(self, vocab: int, grad_accum: int):
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(vocab, 32)
        self.head = torch.nn.Linear(32, vocab)
        self.grad_accum = grad_accum
        self.seen = []  # first token of every sample trained on, to check resume exactly

    def training_step(self, batch, i):
        self.seen += batch["input_ids"][:, 0].tolist()
        logits = self.head(self.emb(batch["input_ids"]))
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class WholeEpochLength(torch.utils.data.Sampler):
    """Lightning counts the batches already run this epoch (restored from the checkpoint) against
    len(dataloader); ChunkSampler's len after a resume is what remains. Report the whole epoch,
    yield what remains: Lightning then ends the epoch exactly when the sampler does."""

    def __init__(self, sampler: ChunkSampler):
        self.sampler = sampler

    def __len__(self):
        return self.sampler.num_samples

    def __iter__(self):
        return iter(self.sampler)


class Data(L.LightningDataModule):
    """Owns the ChunkSampler; its state (samples consumed) goes into Lightning's checkpoint."""

    def __init__(self, out: str, batch_size: int):
        super().__init__()
        self.ds = MemmapChunkDataset(out)
        self.sampler = ChunkSampler(self.ds, seed=0)
        self.batch_size = batch_size

    def train_dataloader(self):
        self.sampler.set_epoch(self.trainer.current_epoch)
        return DataLoader(self.ds, batch_size=self.batch_size, sampler=WholeEpochLength(self.sampler),
                          collate_fn=self.ds.collate)

    def state_dict(self):
        # "processed", not "completed": a checkpoint saved in on_train_batch_end is taken before
        # Lightning counts that batch as completed, and the batch is done.
        done = self.trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"sampler": self.sampler.state_dict(samples_consumed=done * self.batch_size)}

    def load_state_dict(self, state):
        self.sampler.load_state_dict(state["sampler"])


class StopAfter(L.Callback):
    def __init__(self, steps: int, path: str):
        self.steps, self.path = steps, path

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.steps and not trainer.fit_loop._should_accumulate():
            trainer.save_checkpoint(self.path)
            trainer.should_stop = True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--stop-after", type=int, default=None)
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--seen", default=None, help="write the first token of every trained sample here (JSON)")
    a = ap.parse_args()
    st = stats_for(a.out, batch_size=a.batch_size, grad_accum=a.grad_accum, epochs=a.epochs)
    vocab = json.load(open(os.path.join(a.out, "manifest.json")))["tokenizer"]["vocab_size"]
    model, data = TinyLM(vocab, a.grad_accum), Data(a.out, a.batch_size)
    trainer = L.Trainer(max_epochs=a.epochs, accumulate_grad_batches=a.grad_accum, use_distributed_sampler=False,
                        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[StopAfter(a.stop_after, a.ckpt)] if a.stop_after else [])
    trainer.fit(model, datamodule=data, ckpt_path=a.resume)
    if a.seen:
        with open(a.seen, "w") as fh:
            json.dump(model.seen, fh)
    print(f"optimizer steps: Lightning ran {trainer.global_step}, helixtok stats said {st.total_optimizer_steps}")
    return 0 if a.stop_after or trainer.global_step == st.total_optimizer_steps else 1


if __name__ == "__main__":
    sys.exit(main())
