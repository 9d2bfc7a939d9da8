#!/usr/bin/env bash
# docs/results/speed.md "Batch throughput": documents per hour over the same generated documents of
#   1. kvcli batch --policy snapkv --budget 128      (one model load, compressed documents decoded together)
#   2. kvcli batch --policy full                     (one model load, the same --max-cache: fewer held at once)
#   3. a shell loop of kvcli run --policy full       (a model load and one document at a time)
# Wall-clock time of each whole command (model loads included), measured here; nothing else may run.
#   benchmarks/batch_throughput.sh [N_DOCS] [WORDS_MIN] [WORDS_MAX]     (default: 20 730 2180, ~1k-3k tokens)
# Environment: MAX_CACHE (cells of the batch cache, default 8192), MAX_TOKENS (answer length, default 64),
# THREADS (KVCLI_THREADS, default: all cores), OUT (default benchmarks/results/batch), PY (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
N=${1:-20}
WMIN=${2:-730}
WMAX=${3:-2180}
MAX_CACHE=${MAX_CACHE:-8192}
MAX_TOKENS=${MAX_TOKENS:-64}
OUT=${OUT:-benchmarks/results/batch}
[[ -n ${THREADS:-} ]] && export KVCLI_THREADS=$THREADS
INSTR="Summarise the log above in three sentences."
mkdir -p "$OUT"
DOCS=$(mktemp -d)
trap 'rm -rf "$DOCS"' EXIT
for ((i = 0; i < N; i++)); do   # word counts spread evenly over [WMIN, WMAX]
    W=$(( WMIN + (N > 1 ? (WMAX - WMIN) * i / (N - 1) : 0) ))
    $PY examples/make_docs.py --words "$W" --seed "$i" -o "$DOCS/log-$(printf %03d "$i").txt"
done

now() { $PY -c 'import time; print(time.time())'; }
timed() {  # timed NAME COMMAND...: runs it, records its wall-clock seconds in $OUT/NAME.seconds
    local name=$1; shift
    local t0; t0=$(now)
    "$@"
    $PY -c 'import sys; print(f"{float(sys.argv[2]) - float(sys.argv[1]):.2f}")' "$t0" "$(now)" > "$OUT/$name.seconds"
    echo "$name: $(cat "$OUT/$name.seconds") s" >&2
}
batch() {  # batch POLICY [ARGS...]
    local name=batch-$1
    rm -f "$OUT/$name.jsonl"
    $PY -m kvcli.cli batch --docs "$DOCS" --policy "$@" -n "$MAX_TOKENS" --max-cache "$MAX_CACHE" -i "$INSTR" \
        -o "$OUT/$name.jsonl" --json -q > "$OUT/$name.summary.json"
}
loop_run_full() {
    rm -f "$OUT/loop-run-full.jsonl"
    for f in "$DOCS"/*.txt; do
        $PY -m kvcli.cli run --policy full -n "$MAX_TOKENS" --doc "$f" --json -q "$INSTR" >> "$OUT/loop-run-full.jsonl"
    done
}

timed batch-snapkv batch snapkv --budget 128
timed batch-full batch full
timed loop-run-full loop_run_full

$PY - "$OUT" "$N" "$MAX_CACHE" "$MAX_TOKENS" <<'EOF' | tee "$OUT/batch-throughput.txt"
import json, sys
from pathlib import Path
out, n, cells, gen = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
print(f"{n} documents, answers of at most {gen} tokens, batch cache {cells} cells")
print(f"{'command':<44} {'answered':>8} {'seconds':>8} {'docs/hour':>10} {'held at once (mean)':>20}")
rows = {}
for name, label in [("batch-snapkv", "kvcli batch --policy snapkv --budget 128"),
                    ("batch-full", "kvcli batch --policy full"),
                    ("loop-run-full", "shell loop of kvcli run --policy full")]:
    lines = [json.loads(x) for x in (out / f"{name}.jsonl").read_text().splitlines() if x.strip()]
    ok = [x for x in lines if x.get("error") is None and x.get("answer") is not None]
    s = float((out / f"{name}.seconds").read_text())
    held = [x["stats"].get("decoded_with") for x in ok if x["stats"].get("decoded_with")]
    rows[name] = {"answered": len(ok), "seconds": s, "docs_per_hour": len(ok) / s * 3600,
                  "decoded_with_mean": sum(held) / len(held) if held else None}
    r = rows[name]
    held = "-" if r["decoded_with_mean"] is None else f"{r['decoded_with_mean']:.1f}"
    print(f"{label:<44} {r['answered']:>8} {s:>8.1f} {r['docs_per_hour']:>10.0f} {held:>20}")
(out / "batch-throughput.json").write_text(json.dumps(rows, indent=1))
EOF
