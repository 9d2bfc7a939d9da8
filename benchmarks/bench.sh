#!/usr/bin/env bash
# The speed / memory / quality figures of docs/results.md: default model, 4k and 8k-token documents.
#   benchmarks/bench.sh [POLICIES]      (default: every policy the registry lists)
#   STEPS=4k,quant REPEAT=2 benchmarks/bench.sh     (a shorter run: which steps, decode repeats)
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
STEPS=${STEPS:-4k,8k,quant}
REPEAT=${REPEAT:-3}
# compresskv with the default model's shipped calibration, given explicitly so the figures do not depend on
# where the calibration is looked up (kvcli/calibration/compresskv.py policy_args)
mapfile -t CKV < <($PY -c "
from kvcli.calibration.lookup import policy_args
from kvcli.models import default_model_path
for k, v in policy_args(default_model_path(), {}).items(): print(f'--policy-arg=compresskv.{k}={v}')")
# 1. 4k-token document: every policy x budget on f16, 16 tokens decoded 3 times per configuration; and batch
#    throughput at equal memory: an 8192-cell cache holding up to 8 copies of the document, decoded together
if [[ ,$STEPS, == *,4k,* ]]; then
$PY -m kvcli.cli bench --threads "$THREADS" --docs "$DOCS/log-4k.txt" --policies "$POLICIES" --budgets 128,256,512 --cache-type f16 \
    "${CKV[@]}" --gen 16 --repeat "$REPEAT" --batch 8 --ctx 8192 --json-out "$OUT/bench-4k.json" --csv "$OUT/bench-4k.csv" \
    --plot "$OUT/bench-4k.png" | tee "$OUT/bench-4k.txt"
fi
# 2. 8k-token document: the same without the batch test
if [[ ,$STEPS, == *,8k,* ]]; then
$PY -m kvcli.cli bench --threads "$THREADS" --docs "$DOCS/log-8k.txt" --policies "$POLICIES" --budgets 128,256,512 --cache-type f16 \
    "${CKV[@]}" --gen 16 --repeat "$REPEAT" --json-out "$OUT/bench-8k.json" --csv "$OUT/bench-8k.csv" --plot "$OUT/bench-8k.png" \
    | tee "$OUT/bench-8k.txt"
fi
# 3. llama.cpp's own KV quantisation, alone and combined with eviction (4k document; f16 full is the quality baseline)
if [[ ,$STEPS, == *,quant,* ]]; then
$PY -m kvcli.cli bench --threads "$THREADS" --docs "$DOCS/log-4k.txt" --policies full,snapkv --budgets 128,256,512 --cache-type f16,q8_0,q4_0 \
    --gen 16 --repeat "$REPEAT" --json-out "$OUT/bench-quant.json" --csv "$OUT/bench-quant.csv" | tee "$OUT/bench-quant.txt"
fi
