#!/usr/bin/env bash
# README command 1: a virtual environment in .venv with the torch build this machine needs and
# helixtok[torch], then the whole job offline in .quickstart/ (a folder this script owns):
# corpus -> tokenizer -> build -> stats -> verify -> one epoch of a tiny model whose optimizer
# steps must equal `helixtok stats`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${HELIXTOK_VENV:-.venv}"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
VENV="$(cd "$VENV" && pwd)"
PIP=("$VENV/bin/python" -m pip)

# torch: detected, never assumed. PyPI's default build is a multi-GB CUDA one, right only where
# an NVIDIA GPU is; elsewhere a CPU build: one pip already sees offline (a local wheel, through
# find-links or a wheelhouse) if there is one, else PyTorch's CPU wheel index.
if "$VENV/bin/python" -c "from importlib.metadata import version; version('torch')" 2>/dev/null; then
    echo "quickstart: torch $("$VENV/bin/python" -c "from importlib.metadata import version; print(version('torch'))") already in $VENV" >&2
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "quickstart: NVIDIA GPU found (nvidia-smi -L): PyPI's torch, a CUDA build" >&2
    "${PIP[@]}" install -q torch
else
    local_wheel="$("${PIP[@]}" install --dry-run --no-deps --no-index --quiet --report - torch 2>/dev/null \
        | "$VENV/bin/python" -c 'import json, sys, urllib.parse
try:
    url = json.load(sys.stdin)["install"][0]["download_info"]["url"]
except (ValueError, LookupError):
    url = ""
path = urllib.parse.unquote(url[len("file://"):]) if url.startswith("file://") else ""
print(path if "+cpu" in path else "")' || true)"
    if [ -n "$local_wheel" ]; then
        echo "quickstart: no NVIDIA GPU; a CPU build of torch found offline: $local_wheel" >&2
        "${PIP[@]}" install -q "$local_wheel"
    else
        echo "quickstart: no NVIDIA GPU; torch's CPU build from https://download.pytorch.org/whl/cpu" >&2
        "${PIP[@]}" install -q torch --index-url https://download.pytorch.org/whl/cpu
    fi
fi
# Keep that torch for every later pip call in this environment, from any folder: a constraint
# named in the environment's own pip.conf (a test extra must not swap it for another build).
# (its version from the metadata: importing torch before numpy is installed prints a warning)
"$VENV/bin/python" -c 'from importlib.metadata import version; print("torch==" + version("torch"))' \
    > "$VENV/torch-constraint.txt"
printf '[global]\nconstraint = %s\n' "$VENV/torch-constraint.txt" > "$VENV/pip.conf"
"${PIP[@]}" install -q -e ".[torch]"
export PATH="$VENV/bin:$PATH"

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
