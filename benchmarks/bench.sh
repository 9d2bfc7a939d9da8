#!/usr/bin/env bash
# The speed / memory / quality figures of docs/results.md: default model, 4k and 8k-token documents.
#   benchmarks/bench.sh [POLICIES]      (default: every policy the registry lists)
# Writes benchmarks/results/bench-{4k,8k,quant}.{json,csv,txt} and bench-4k.png, bench-4k-batch.png.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/results
mkdir -p "$OUT"
DOCS=$(mktemp -d)
trap 'rm -rf "$DOCS"' EXIT
$PY benchmarks/make_docs.py "$DOCS" >/dev/null
THREADS=${THREADS:-1}  # the figures in docs/results.md: 1 thread (the machine was oversubscribed, see there)
POLICIES=${1:-$($PY -c "from kvcli.policies import available; print(','.join(available()))")}
# 1. 4k-token document: every policy x budget on f16, 16 tokens decoded 3 times per configuration; and batch
#    throughput at equal memory: an 8192-cell cache holding up to 8 copies of the document, decoded together
$PY -m kvcli.cli bench --threads "$THREADS" --docs "$DOCS/log-4k.txt" --policies "$POLICIES" --budgets 128,256,512 --cache-type f16 \
    --gen 16 --repeat 3 --batch 8 --ctx 8192 --json-out "$OUT/bench-4k.json" --csv "$OUT/bench-4k.csv" \
    --plot "$OUT/bench-4k.png" | tee "$OUT/bench-4k.txt"
# 2. 8k-token document: the same without the batch test
$PY -m kvcli.cli bench --threads "$THREADS" --docs "$DOCS/log-8k.txt" --policies "$POLICIES" --budgets 128,256,512 --cache-type f16 \
    --gen 16 --repeat 3 --json-out "$OUT/bench-8k.json" --csv "$OUT/bench-8k.csv" --plot "$OUT/bench-8k.png" \
    | tee "$OUT/bench-8k.txt"
# 3. llama.cpp's own KV quantisation, alone and combined with eviction (4k document)
$PY -m kvcli.cli bench --threads "$THREADS" --docs "$DOCS/log-4k.txt" --policies full,snapkv --budgets 128,256,512 --cache-type q8_0,q4_0 \
    --gen 16 --repeat 3 --json-out "$OUT/bench-quant.json" --csv "$OUT/bench-quant.csv" | tee "$OUT/bench-quant.txt"
