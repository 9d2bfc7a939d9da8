#!/usr/bin/env bash
# Quality on Qwen2.5-Coder-0.5B-Instruct (issue 16): the RULER-style tasks at 4k, 8k and 16k tokens, every policy x
# budgets 128/256/512 plus plain truncation, and fidelity at 4k/8k/16k. This is how the tables in docs/results.md
# ("Quality on qwen2.5-coder-0.5b") were measured: in rounds of one prompt per task, each round with its own seed
# and needle depth, merged afterwards; a round whose JSON exists is skipped, so the script resumes and more rounds
# can be added to ROUNDS_* (cost on the 2-core project machine, 2 threads: ~6 min / ~18 min / ~20-60 min per round at
# 4k / 8k / 16k; 16k took 20 min per round on a freshly set-up machine with nothing beside it).
#   benchmarks/eval_qwen.sh [LENGTHS]        # e.g. "16k"; default "4k 8k 16k fidelity"
# Needs: kvcli models pull qwen2.5-coder-0.5b. compresskv uses the shipped calibration for this model.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-benchmarks/results/qwen2.5-coder-0.5b}
THREADS=${THREADS:-2}
MODEL=qwen2.5-coder-0.5b
POLICIES=full,truncate,streamingllm,snapkv,h2o,pyramidkv,windowkv,dynamickv,compresskv,d2o,spindlekv
# seed:depth per round
ROUNDS_4k="0:0.25 1:0.75 2:0.5 3:0.1 4:0.9"
ROUNDS_8k="0:0.5 1:0.25 2:0.75 3:0.1 4:0.9 5:0.4 6:0.6"
ROUNDS_16k="0:0.5 1:0.25 2:0.75 3:0.1 4:0.9 5:0.4 6:0.6 7:0.3"
mkdir -p "$OUT"
$PY -m kvcli.cli models pull "$MODEL" >/dev/null
for L in ${1:-4k 8k 16k fidelity}; do
  if [ "$L" = fidelity ]; then
    [ -e "$OUT/fidelity-4k.json" ] || $PY -m kvcli.cli eval fidelity --model "$MODEL" --threads "$THREADS" \
        --policies "${POLICIES/truncate,/}" --budgets 128,256,512 --lengths 4k --docs examples/station-log.txt \
        --cont 64 --json-out "$OUT/fidelity-4k.json"
    for seed in 5 6; do
      json="$OUT/fidelity-8k16k$([ $seed = 5 ] || echo -s$seed).json"
      [ -e "$json" ] && continue
      doc=$(mktemp -d)/logbook-19k-s$seed.txt
      $PY examples/make_docs.py --tokens 19000 --seed $seed -o "$doc"
      $PY -m kvcli.cli eval fidelity --model "$MODEL" --threads "$THREADS" --policies "${POLICIES/truncate,/}" \
          --budgets 128,256,512 --lengths 8k,16k --docs "$doc" --cont 64 --json-out "$json"
    done
    $PY benchmarks/tables.py --merge "$OUT"/fidelity-*.json
    continue
  fi
  rounds=ROUNDS_$L
  tasks=niah_single,niah_multikey,vt
  [ "$L" = 4k ] && tasks=$tasks,cwe
  for r in ${!rounds}; do
    seed=${r%%:*} depth=${r#*:}
    [ -e "$OUT/ruler-$L-r$seed.json" ] && continue
    $PY -m kvcli.cli eval ruler --model "$MODEL" --threads "$THREADS" --policies "$POLICIES" --budgets 128,256,512 \
        --lengths "$L" --tasks "$tasks" --depths "$depth" --samples 1 --seed "$seed" --json-out "$OUT/ruler-$L-r$seed.json"
  done
  $PY benchmarks/tables.py --merge "$OUT"/ruler-$L-r*.json
done
# the figures in docs/results.md, from every round and document measured so far
for kind in ruler fidelity; do
  if compgen -G "$OUT/$kind-*.json" >/dev/null; then
    $PY benchmarks/tables.py --merge "$OUT"/$kind-*.json --plot "$OUT/$kind.png" >/dev/null
  fi
done
