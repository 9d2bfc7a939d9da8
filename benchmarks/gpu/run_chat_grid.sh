#!/usr/bin/env bash
# Issue #30's multi-question evaluation grid on a lent GPU, on qwen2.5-coder-0.5b (491 MB: carried in ten calls as
# parts of `split -n 10` into /tmp/q, with .gpuq10/model.sha256), after pack.sh packed .gpu/:
#   T8=170 T4=90 T16=120 bash benchmarks/gpu/run_chat_grid.sh      (from the repo root; results under $OUT)
# Each length is one `kvcli eval chat` process stopped by SIGINT at its time limit (an interrupted evaluation keeps
# what it scored): 8k on the 8k tables' documents (seed 0; snapkv beside the others, to compare with the CPU's
# scores), 4k on the 4k tables' (seed 1), 16k (seed 0). Scores are greedy; the GPU's arithmetic is not the CPU's.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/main.log") 2>&1
date -u
source benchmarks/gpu/device_env.sh || exit 1
M=/tmp/q/qwen2.5-coder-0.5b.gguf
cat /tmp/q/part* > $M && (cd /tmp/q && sha256sum -c model.sha256) || exit 1
rm -f /tmp/q/part*
cd "$G/src"
P=${POLICIES:-dynamickv,h2o,streamingllm,kvzip,windowkv,d2o,spindlekv,expected_attention}
ev() {
    local t=$1 name=$2; shift 2
    [ "$t" -gt 0 ] || return 0
    date -u
    timeout -s INT -k 15 "$t" python3 -m kvcli.cli eval chat --model $M --budgets 128,256,512 --documents 2 --facts 6 \
        --modes full,once,reselect,run "$@" --json-out "$OUT/$name.json"
    echo "$name: exit $?"
}
ev "${T8:-170}" grid-8k --policies snapkv,$P --lengths 8k
ev "${T4:-90}" grid-4k --policies $P --lengths 4k --seed 1
ev "${T16:-120}" grid-16k --policies $P --lengths 16k
date -u
