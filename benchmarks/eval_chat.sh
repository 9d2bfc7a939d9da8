#!/usr/bin/env bash
# The multi-question evaluation of docs/results.md ("Many questions over one document"): qwen2.5-coder-0.5b,
# every question of a document asked in one conversation, for full / compress-once / re-selected / each question
# alone (run). Measure alone on a quiet machine (the JSON's machine field records the load).
# LENGTHS / DOCS / POLICIES / BUDGETS override the defaults; reread (the document read again per question) is
# left out: it costs a read per question.
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvcli
OUT=benchmarks/results
POL=${POLICIES:-snapkv,compresskv,pyramidkv,h2o,streamingllm}
BUD=${BUDGETS:-256}
for L in ${LENGTHS:-8k 4k 16k}; do
  $K eval chat --model qwen2.5-coder-0.5b --policies $POL --budgets $BUD --lengths $L --documents ${DOCS:-2} \
    --facts 6 --threads 2 --json-out $OUT/eval-chat-qwen-$L.json --plot docs/eval-chat-qwen-$L.png
done
