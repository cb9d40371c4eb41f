#!/usr/bin/env bash
# README command 1: a virtual environment in .venv with helixtok installed, then the whole job
# offline in .quickstart/ (a folder this script owns): corpus -> tokenizer -> build -> stats ->
# verify -> one epoch of a tiny model whose optimizer steps must equal `helixtok stats`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HELIXTOK_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q -e ".[test]"   # [test] includes [torch]
export PATH="$PWD/$VENV/bin:$PATH"

W=.quickstart
if [ -e "$W" ] && [ ! -e "$W/.made-by-quickstart" ]; then
    echo "quickstart: $W exists and was not made by this script; move it away" >&2
    exit 1
fi
rm -rf "$W"
mkdir "$W"
touch "$W/.made-by-quickstart"
echo "quickstart: working in $PWD/$W" >&2

python scripts/make_sample_corpus.py "$W/corpus"
helixtok train-tokenizer "$W/corpus" "$W/tokenizer.json" --vocab-size 4096
helixtok build "$W/corpus" "$W/data" --tokenizer "$W/tokenizer.json" --seq-len 256 --val-fraction 0.05 \
    --shard-size 1MiB
helixtok stats "$W/data" --batch-size 16 --grad-accum 2 --epochs 1 --warmup-ratio 0.05
helixtok verify "$W/data"
python scripts/train_example.py --data "$W/data" --batch-size 16 --grad-accum 2 --epochs 1 \
    --checkpoint "$W/checkpoint.pt"
echo "quickstart: done; everything it made is in $PWD/$W" >&2
