#!/usr/bin/env bash
# The figures of docs/long-documents.md: documents longer than the default model's 8,192-token context.
#   benchmarks/long.sh [run|niah|niah-baselines|needle|all]     (default: all)
# 1. a ~100k-token logbook with 10 facts planted at depths 0.05..0.95 (examples/make_docs.py), read by
#    `kvcli run --policy snapkv --budget 512` (chunks of 1,024 by themselves), asked for the deepest fact;
# 2. NIAH at 10k tokens (past the context: read in chunks): snapkv and compresskv with each --chunk-scoring,
#    streamingllm and plain truncation as baselines, and the share of the needle's tokens still held.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=benchmarks/results
STEP=${1:-all}
mkdir -p "$OUT"
if [[ $STEP == run || $STEP == all ]]; then
    BOOK=$(mktemp -d)
    trap 'rm -rf "$BOOK"' EXIT
    $PY examples/make_docs.py --tokens 100000 --facts 10 -o "$BOOK/book.txt" --facts-json "$OUT/book-100k-facts.json"
    Q=$($PY -c "import json,sys; print(json.load(open(sys.argv[1]))[-1]['question'])" "$OUT/book-100k-facts.json")
    $PY -m kvcli.cli run --policy snapkv --budget 512 --doc "$BOOK/book.txt" -n 32 --json "$Q" \
        > "$OUT/run-100k-snapkv512-question.json"   # (run-100k-snapkv512.json: before question scoring)
fi
if [[ $STEP == niah || $STEP == all ]]; then
    # the two chunk scorings (kvcli/drivers/chunked.py) on the same samples
    for SC in question chunk; do
        $PY -m kvcli.cli eval niah --threads 2 --lengths 10k --depths 0.1,0.5,0.9 --policies snapkv,compresskv \
            --budgets 512 --samples 1 --chunk-scoring $SC --json-out "$OUT/niah-long-$SC.json" \
            --plot "$OUT/niah-long-$SC.png" 2>&1 | tee "$OUT/niah-long-$SC.txt"
    done
fi
if [[ $STEP == niah-baselines || $STEP == all ]]; then
    # positional and truncation baselines (no chunk scoring involved; first run before the two above)
    $PY -m kvcli.cli eval niah --threads 1 --lengths 10k --depths 0.1,0.5,0.9 --policies snapkv,streamingllm,truncate \
        --budgets 512 --samples 1 --json-out "$OUT/niah-long.json" --plot "$OUT/niah-long.png" | tee "$OUT/niah-long.txt"
fi
if [[ $STEP == needle || $STEP == all ]]; then
    # does the needle survive? its tokens' share in the final cache, per scoring (benchmarks/needle_survival.py)
    $PY benchmarks/needle_survival.py 10240 0.1,0.5,0.9 question,chunk snapkv | tee "$OUT/needle-survival-snapkv.txt"
fi
