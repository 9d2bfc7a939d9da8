#!/usr/bin/env bash
# Issue #45's comparison at equal memory: each policy's score against the K/V bytes its cache holds, qwen2.5-coder-0.5b
# at 8k, budgets 64 / 256 / 1024: the multi-question chat (re-selected per question, as kvcli chat does; two
# documents of six facts, seed 0 = the documents of eval-chat-qwen-8k-dynamickv64-*.json) and RULER's needles
# (question-aware). kvzip is question-agnostic: compressed once, both allocations. The scores are greedy, so they do
# not depend on the load; the seconds do (the JSON's machine field records it).
# Table and figure: python benchmarks/score_vs_bytes_table.py.
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvcli
OUT=benchmarks/results
POL=${POLICIES:-snapkv,pyramidkv,dynamickv,compresskv,windowkv,d2o,spindlekv}
BUD=${BUDGETS:-64,256,1024}
PART=${PART:-all}
if [ "$PART" = all ] || [ "$PART" = chat ]; then
  $K eval chat --model qwen2.5-coder-0.5b --policies $POL --budgets $BUD --lengths 8k --documents 2 --facts 6 \
    --modes full,reselect --threads 2 --json-out $OUT/score-bytes-chat-qwen-8k.json
fi
if [ "$PART" = all ] || [ "$PART" = ruler ]; then
  $K eval ruler --model qwen2.5-coder-0.5b --policies full,$POL --budgets $BUD --lengths 8k \
    --tasks niah_single,niah_multikey,vt --depths 0.25,0.75 --samples 1 --threads 2 \
    --json-out $OUT/score-bytes-ruler-qwen-8k.json
fi
if [ "$PART" = all ] || [ "$PART" = kvzip ]; then
  for A in head global; do
    $K eval chat --model qwen2.5-coder-0.5b --policies kvzip --policy-arg kvzip.alloc=$A --budgets $BUD --lengths 8k \
      --documents 2 --facts 6 --modes once --threads 2 --json-out $OUT/score-bytes-chat-qwen-8k-kvzip-$A.json
  done
fi
