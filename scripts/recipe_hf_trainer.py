"""HF transformers.Trainer on a helixtok dataset: ChunkSampler as its sampler, steps equal to `helixtok stats`.

Usage: python scripts/recipe_hf_trainer.py OUT [--batch-size 8] [--grad-accum 2] [--epochs 1]
Trains a tiny GPT-2 on CPU and prints the optimizer steps the Trainer ran and what stats predicted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from helixtok import ChunkSampler, MemmapChunkDataset  # noqa: E402
from helixtok.read.stats import stats_for  # noqa: E402


class ChunkTrainer(Trainer):
    """The one change a Trainer needs: its training order comes from ChunkSampler (seeded,
    resumable, exact len), not a RandomSampler."""

    def _get_train_sampler(self, *args, **kwargs):
        return ChunkSampler(self.train_dataset, seed=self.args.seed, rank=max(self.args.process_index, 0),
                            world_size=self.args.world_size)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--grad-accum", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--output-dir", default=None)
    ap.add_argument("--own-sampler", action="store_true",
                    help="keep the Trainer's own RandomSampler (same len, so the same step count; no exact resume)")
    ap.add_argument("--max-steps", action="store_true", help="pass max_steps = stats' total_optimizer_steps")
    a = ap.parse_args()
    ds = MemmapChunkDataset(a.out)
    st = stats_for(a.out, batch_size=a.batch_size, grad_accum=a.grad_accum, epochs=a.epochs)
    tok = json.load(open(os.path.join(a.out, "manifest.json")))["tokenizer"]
    # The dataset's own special ids (GPT2Config's defaults, 50256, lie outside a smaller vocabulary).
    eos = tok["eos_id"]
    bos = tok["bos_id"] if tok.get("bos_id") is not None else eos
    model = GPT2LMHeadModel(GPT2Config(vocab_size=tok["vocab_size"], n_positions=ds.seq_len, n_embd=32, n_layer=1,
                                       n_head=2, bos_token_id=bos, eos_token_id=eos, pad_token_id=tok["pad_id"]))
    args = TrainingArguments(output_dir=a.output_dir or os.path.join(a.out, "..", "hf-trainer-run"),
                             per_device_train_batch_size=a.batch_size, gradient_accumulation_steps=a.grad_accum,
                             num_train_epochs=a.epochs, max_steps=st.total_optimizer_steps if a.max_steps else -1,
                             learning_rate=1e-3, warmup_steps=st.warmup_steps,
                             logging_steps=10, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, seed=0, disable_tqdm=True)
    trainer = (Trainer if a.own_sampler else ChunkTrainer)(model=model, args=args, train_dataset=ds,
                                                           data_collator=ds.collate)
    trainer.train()
    print(f"optimizer steps: Trainer ran {trainer.state.global_step}, helixtok stats said {st.total_optimizer_steps}")
    return 0 if trainer.state.global_step == st.total_optimizer_steps else 1


if __name__ == "__main__":
    sys.exit(main())
