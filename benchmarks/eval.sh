#!/usr/bin/env bash
# The quality figures of docs/results.md: NIAH, RULER-style tasks and fidelity on the default model.
#   benchmarks/eval.sh [POLICIES]
# Lengths are calibrated to where the 135M default model's full cache succeeds (docs/results.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/results
mkdir -p "$OUT"
POLICIES=${1:-$($PY -c "from kvcli.policies import available; print(','.join(available()))")}
$PY -m kvcli.cli eval niah --policies "$POLICIES" --budgets 128,256,512 --lengths 1k,2k \
    --depths 0.1,0.3,0.5,0.7,0.9 --samples 1 --json-out "$OUT/niah.json" --plot "$OUT/niah.png" | tee "$OUT/niah.txt"
$PY -m kvcli.cli eval ruler --policies "$POLICIES" --budgets 128,256,512 --lengths 1k \
    --tasks niah_single,niah_multikey,vt,cwe --samples 2 --json-out "$OUT/ruler.json" --plot "$OUT/ruler.png" \
    | tee "$OUT/ruler.txt"
$PY -m kvcli.cli eval fidelity --policies "$POLICIES" --budgets 128,256,512 --lengths 2k \
    --docs examples/station-log.txt --cont 64 --json-out "$OUT/fidelity.json" --plot "$OUT/fidelity.png" \
    | tee "$OUT/fidelity.txt"
