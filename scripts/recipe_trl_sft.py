"""TRL's SFTTrainer on a helixtok chat build: helixtok.to_hf(OUT) as its train_dataset, nothing tokenized again.

Usage: python scripts/recipe_trl_sft.py OUT -t TOKENIZER_DIR [--steps 3] [--batch-size 4] [--packing]
Trains a tiny Llama-shaped model on CPU for a few steps and prints, as JSON, the steps run, the last
loss, and whether every label TRL trains on is where the build's mask says (its labels = the ids
where assistant_masks is 1, -100 elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="a helixtok chat build (packed or bestfit)")
    ap.add_argument("-t", "--tokenizer", required=True, help="the folder of its tokenizer.json and tokenizer_config.json")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--packing", action="store_true", help="TRL packs the rows (padding-free) into --max-length")
    ap.add_argument("--max-length", type=int, default=None, help="with --packing: its rows' length [default: 1024]")
    a = ap.parse_args(argv)

    import transformers
    from trl import SFTConfig, SFTTrainer

    import helixtok

    with open(os.path.join(a.tokenizer, "tokenizer_config.json")) as fh:
        config = json.load(fh)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(a.tokenizer, "tokenizer.json"),
        **{k: v for k, v in config.items() if k in ("bos_token", "eos_token", "pad_token")})
    train = helixtok.to_hf(a.out)  # input_ids and assistant_masks, memory-mapped: no tokenization here
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=8192))
    with tempfile.TemporaryDirectory() as work:
        args = SFTConfig(output_dir=work, max_steps=a.steps, per_device_train_batch_size=a.batch_size,
                         logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, bf16=False,
                         max_length=(a.max_length or 1024) if a.packing else a.max_length, packing=a.packing, dataloader_num_workers=0, seed=0)
        trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
        result = trainer.train()
    prepared = trainer.train_dataset  # TRL's labels, built from the build's mask
    same = (len(prepared) == len(train) and all(
        r["input_ids"] == t["input_ids"] and [x != -100 for x in r["labels"]] == [bool(m) for m in t["assistant_masks"]]
        for r, t in zip(prepared, train))) if not a.packing else None
    report = {"steps": result.global_step, "loss": result.training_loss, "rows": len(train),
              "labels_are_the_mask": same}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
