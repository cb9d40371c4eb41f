#!/usr/bin/env bash
# Two versions of helixtok side by side on the same corpus: REV (a commit, in a temporary worktree)
# and this checkout, alternating, at each -j given; per run: wall, the build's own CPU (the
# coordinator: RUSAGE_SELF), its workers' (RUSAGE_CHILDREN), peak and final disk of OUT.
#   scripts/bench_ab.sh REV CORPUS TOKENIZER [ROUNDS] [-- build options]   (e.g. -- -L 2048 --val-fraction 0.01)
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
REV=$1 CORPUS="$(realpath "$2")" TOK="$(realpath "$3")" ROUNDS=${4:-2}
shift $(( $# >= 4 ? 4 : 3 )); [ "${1:-}" = "--" ] && shift
PY="$REPO/.venv/bin/python"
W="$(mktemp -d)"
trap 'git -C "$REPO" worktree remove --force "$W/base" >/dev/null 2>&1 || true; rm -rf "$W"' EXIT
git -C "$REPO" worktree add -f -q "$W/base" "$REV"
cat > "$W/run.py" <<'PYEOF'
import resource, sys, time
sys.argv = ["helixtok"] + sys.argv[1:]
from helixtok.cli.entry import main
t = time.time()
try:
    main()
except SystemExit as e:
    assert not e.code, e.code
s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"wall {time.time() - t:.2f} s, coordinator {s.ru_utime + s.ru_stime:.2f} s CPU, workers "
      f"{c.ru_utime + c.ru_stime:.2f} s", file=sys.stderr)
PYEOF
run() {  # label, tree, -j
    out="$W/out"; rm -rf "$out"
    (cd "$W" && PYTHONPATH="$2" "$PY" "$W/run.py" build "$CORPUS" "$out" -t "$TOK" -q -j "$3" "${OPTS[@]}" \
        >/dev/null 2>"$W/err") & pid=$!
    peak=0
    while kill -0 $pid 2>/dev/null; do d=$(du -sb "$out" 2>/dev/null | cut -f1 || true); [ "${d:-0}" -gt "$peak" ] && peak=$d; sleep 0.5; done
    wait $pid
    echo "$1 -j $3: $(tail -1 "$W/err"), disk peak $peak B, final $(du -sb "$out" | cut -f1) B"
}
OPTS=("$@")
run warm-up "$REPO" 2
for r in $(seq "$ROUNDS"); do
    for j in 1 2; do  # (the order alternates by round: a drifting machine shows as a difference that flips)
        if [ $((r % 2)) = 1 ]; then run "$REV" "$W/base" $j; run HEAD "$REPO" $j; else run HEAD "$REPO" $j; run "$REV" "$W/base" $j; fi
    done
done
