#!/usr/bin/env bash
# Quality on Qwen2.5-Coder-0.5B-Instruct (issue 16): NIAH and the RULER-style tasks at 4k, 8k and 16k tokens,
# every policy x budgets 128/256/512 plus plain truncation, and fidelity. NOT run yet (too heavy for the shared
# 2-core machine); the lead runs it alone:
#   benchmarks/eval_qwen.sh [POLICIES]        # needs: kvcli models pull qwen2.5-coder-0.5b
# Samples: 5 depths x 4 samples = 20 prompts per NIAH cell and 8 per RULER task cell, so a cell's score moves
# in steps of 0.05 (NIAH) / 0.125 (RULER); the JSON keeps every prompt's score for the spread.
# compresskv runs with its all-head fallback unless a calibration for this model exists (kvcli info shows it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=benchmarks/results/qwen2.5-coder-0.5b
mkdir -p "$OUT"
THREADS=${THREADS:-2}
MODEL=qwen2.5-coder-0.5b
$PY -m kvcli.cli models pull "$MODEL" >/dev/null
POLICIES=${1:-$($PY -c "from kvcli.policies import available; print(','.join(available()))"),truncate}
for L in 4k 8k 16k; do
  $PY -m kvcli.cli eval niah --model "$MODEL" --threads "$THREADS" --policies "$POLICIES" --budgets 128,256,512 \
      --lengths "$L" --depths 0.1,0.3,0.5,0.7,0.9 --samples 4 \
      --json-out "$OUT/niah-$L.json" --plot "$OUT/niah-$L.png" | tee "$OUT/niah-$L.txt"
  $PY -m kvcli.cli eval ruler --model "$MODEL" --threads "$THREADS" --policies "$POLICIES" --budgets 128,256,512 \
      --lengths "$L" --tasks niah_single,niah_multikey,vt,cwe --samples 8 \
      --json-out "$OUT/ruler-$L.json" --plot "$OUT/ruler-$L.png" | tee "$OUT/ruler-$L.txt"
done
$PY -m kvcli.cli eval fidelity --model "$MODEL" --threads "$THREADS" --policies "${POLICIES%,truncate}" \
    --budgets 128,256,512 --lengths 4k --docs examples/station-log.txt --cont 64 \
    --json-out "$OUT/fidelity.json" --plot "$OUT/fidelity.png" | tee "$OUT/fidelity.txt"
