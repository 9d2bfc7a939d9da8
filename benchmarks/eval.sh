#!/usr/bin/env bash
# The quality figures of docs/results.md: NIAH, RULER-style tasks and fidelity on the default model.
#   benchmarks/eval.sh [POLICIES]
# Lengths are calibrated to where the 135M default model's full cache succeeds (docs/results.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/results
mkdir -p "$OUT"
THREADS=${THREADS:-1}  # the figures in docs/results.md: 1 thread (the machine was oversubscribed, see there)
POLICIES=${1:-$($PY -c "from kvcli.policies import available; print(','.join(available()))")}
# compresskv with the default model's shipped calibration, given explicitly (kvcli/calibration/compresskv.py)
mapfile -t CKV < <($PY -c "
from kvcli.calibration.lookup import policy_args
from kvcli.models import default_model_path
for k, v in policy_args(default_model_path(), {}).items(): print(f'--policy-arg=compresskv.{k}={v}')")
$PY -m kvcli.cli eval niah --threads "$THREADS" --policies "$POLICIES" "${CKV[@]}" --budgets 128,256,512 --lengths 1k \
    --depths 0.1,0.5,0.9 --samples 1 --json-out "$OUT/niah.json" --plot "$OUT/niah.png" | tee "$OUT/niah.txt"
$PY -m kvcli.cli eval ruler --threads "$THREADS" --policies "$POLICIES" "${CKV[@]}" --budgets 128,256,512 --lengths 1k \
    --tasks niah_single,niah_multikey,vt,cwe --samples 2 --json-out "$OUT/ruler.json" --plot "$OUT/ruler.png" \
    | tee "$OUT/ruler.txt"
$PY -m kvcli.cli eval fidelity --threads "$THREADS" --policies "$POLICIES" "${CKV[@]}" --budgets 128,256,512 --lengths 2k \
    --docs examples/station-log.txt --cont 64 --json-out "$OUT/fidelity.json" --plot "$OUT/fidelity.png" \
    | tee "$OUT/fidelity.txt"
