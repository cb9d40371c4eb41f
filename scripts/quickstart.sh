#!/usr/bin/env bash
# The README's first command: install, then an offline build + stats on a corpus made on the spot.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test]"
rm -rf sample out tok.json
python scripts/make_sample_corpus.py sample
helixtok train-tokenizer sample tok.json --vocab-size 4096
helixtok build sample out --tokenizer tok.json --seq-len 256 --val-fraction 0.05 --shard-size 1MiB
helixtok stats out --batch-size 8 --grad-accum 2 --epochs 2 --warmup-ratio 0.05
helixtok verify out
