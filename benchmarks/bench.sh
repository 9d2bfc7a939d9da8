#!/usr/bin/env bash
# The speed / memory / quality figures of docs/results.md: default model, 4k and 8k-token documents.
#   benchmarks/bench.sh [POLICIES]      (default: every policy the registry lists)
# Writes benchmarks/results/bench{,-quant}.{json,csv,txt}, bench.png and bench-batch.png.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/results
mkdir -p "$OUT"
DOCS=$(mktemp -d)
$PY benchmarks/make_docs.py "$DOCS" >/dev/null
POLICIES=${1:-$($PY -c "from kvcli.policies import available; print(','.join(available()))")}
# 1. every policy x budget on f16: 32 tokens decoded 3 times per configuration; and batch throughput at
#    equal memory: an 8192-cell cache holding up to 16 documents (4k and 8k alternately), decoded together
$PY -m kvcli.cli bench --docs "$DOCS" --policies "$POLICIES" --budgets 128,256,512 --cache-type f16 \
    --gen 32 --repeat 3 --batch 16 --ctx 8192 --json-out "$OUT/bench.json" --csv "$OUT/bench.csv" \
    --plot "$OUT/bench.png" | tee "$OUT/bench.txt"
# 2. llama.cpp's own KV quantisation, alone and combined with eviction
$PY -m kvcli.cli bench --docs "$DOCS" --policies full,snapkv --budgets 128,256,512 --cache-type q8_0,q4_0 \
    --gen 32 --repeat 3 --json-out "$OUT/bench-quant.json" --csv "$OUT/bench-quant.csv" | tee "$OUT/bench-quant.txt"
rm -rf "$DOCS"
