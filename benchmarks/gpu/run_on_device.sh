#!/usr/bin/env bash
# Issue #17's checks on a lent GPU machine (the device tool), from the repo root, after benchmarks/gpu/pack.sh:
#   bash .gpu/src/benchmarks/gpu/run_on_device.sh [gpu_check.py's options]   (results under $OUT; ~3 minutes on an H200)
#   GPU_CHECK_ONLY=1: gpu_check.py alone (no kvcli run, no tests)
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
source benchmarks/gpu/device_env.sh || exit 1
cd "$G/src"
timeout 240 python3 benchmarks/gpu/gpu_check.py --out "$OUT" "$@" 2>&1 | tee "$OUT/gpu_check.log"
echo "gpu_check exit: ${PIPESTATUS[0]}"
[ "${GPU_CHECK_ONLY:-0}" = 1 ] && exit 0      # the checks alone (a short run: the speed section, say)
# the command line on the GPU, on gpu_check's random model of qwen2.5-0.5B's shape (its answer is noise)
M=/tmp/kvcli_gpu_qwen05.gguf
{ python3 -m kvcli.cli info $M
  timeout 60 python3 -m kvcli.cli run --model $M --doc examples/station-log.txt --policy snapkv --budget 256 -n 16 \
      --json "What is the locker number of the lower lake?"; } 2>&1 | tee "$OUT/cli.txt"
# the native tests (less the one that loads the default model, which does not travel), on the GPU build
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/native --ignore=tests/native/test_default_model.py \
    --maxfail=20 --tb=short > "$OUT/native-tests.txt" 2>&1
echo "native tests exit: $?"; tail -25 "$OUT/native-tests.txt"
# the observation tests compare f32 caches with a float64 reference: once more with cuBLAS's TF32 off
NVIDIA_TF32_OVERRIDE=0 timeout 60 python3 -m pytest -q -p no:cacheprovider tests/native/test_observation.py \
    tests/native/test_reindex.py -k observation --tb=line 2>&1 | tail -8
