#!/usr/bin/env bash
# Issue #46's quality at length: `kvcli eval chat` (six planted facts, six questions in one conversation) on
# qwen2.5-coder-0.5b at 31k (the longest document whose full cache and conversation fit its 32k context), 64k and
# 128k tokens, snapkv at budgets 256 / 1024 / 4096: the bounded form as kvcli chat serves it (the block index's
# chosen chunks: `bounded`) against the form before the index (every chunk, a probe each: `bounded_all`), from the
# same read; at 31k also the full cache and exact re-selection. One process per length and budget, so a stopped run
# keeps what it finished. Each read is minutes (about 3 at 31k, 14 at 128k); measure alone.
# LENGTHS / BUDGETS override the defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
K=.venv/bin/kvcli
OUT=benchmarks/results
for L in ${LENGTHS:-31k 64k 128k}; do
  if [ "$L" = 31k ]; then   # one process: the full cache read once for every budget
    budgets=$(echo ${BUDGETS:-1024 256 4096} | tr ' ' ,)
    [ -e "$OUT/book-quality-qwen-$L.json" ] ||
      $K eval chat --model qwen2.5-coder-0.5b --policies snapkv --budgets "$budgets" --lengths "$L" --documents 1 \
        --facts 6 --modes full,reselect,bounded,bounded_all --threads 2 --seed 46 \
        --json-out "$OUT/book-quality-qwen-$L.json"
    continue
  fi
  for B in ${BUDGETS:-1024 256 4096}; do
    [ -e "$OUT/book-quality-qwen-$L-b$B.json" ] && continue
    modes=bounded,bounded_all
    # every chunk with a probe each costs about a minute per question at 128k: measured at budget 1024 there
    # unless ALL_FORMS=1
    if [ "$L" = 128k ] && [ "$B" != 1024 ] && [ -z "${ALL_FORMS:-}" ]; then modes=bounded; fi
    $K eval chat --model qwen2.5-coder-0.5b --policies snapkv --budgets "$B" --lengths "$L" --documents 1 \
      --facts 6 --modes "$modes" --threads 2 --seed 46 --json-out "$OUT/book-quality-qwen-$L-b$B.json"
  done
done
