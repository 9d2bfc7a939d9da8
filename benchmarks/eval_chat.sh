#!/usr/bin/env bash
# The multi-question evaluation of docs/results.md ("Many questions over one document"): qwen2.5-coder-0.5b,
# every question of a document asked in one conversation, for full / compress-once / re-selected / question-aware
# run. Measure alone on a quiet machine (uptime is recorded in each JSON's machine field).
# 16k: the run mode (the document read again for every question, ~4 min a read here) is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvcli
OUT=benchmarks/results
POL=snapkv,compresskv,pyramidkv,h2o,streamingllm
$K eval chat --model qwen2.5-coder-0.5b --policies $POL --budgets 128,256,512 --lengths 8k --documents 2 --facts 6 \
  --threads 2 --json-out $OUT/eval-chat-qwen-8k.json --plot docs/eval-chat-qwen-8k.png
$K eval chat --model qwen2.5-coder-0.5b --policies $POL --budgets 128,256,512 --lengths 4k --documents 3 --facts 6 \
  --threads 2 --seed 1 --json-out $OUT/eval-chat-qwen-4k.json --plot docs/eval-chat-qwen-4k.png
$K eval chat --model qwen2.5-coder-0.5b --policies $POL --budgets 128,256,512 --lengths 16k --documents 2 --facts 6 \
  --modes full,once,reselect --threads 2 --seed 2 --json-out $OUT/eval-chat-qwen-16k.json --plot docs/eval-chat-qwen-16k.png
