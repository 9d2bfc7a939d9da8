#!/usr/bin/env bash
# The real default model on a lent GPU (after model_parts.sh carried and joined it, and pack.sh packed .gpu/):
#   bash benchmarks/gpu/run_real_model.sh          (from the repo root; results under $OUT, at most 8 files)
# 1. answers: `kvcli run` full and snapkv on the two bundled documents and a piped re-selected `kvcli chat` (the
#    same commands on a CPU build elsewhere give the answers to compare);
# 2. native_decode.py on the real model: decode tok/s of snapkv@256 vs full (f16, q8_0, q4_0) at 7.5k tokens;
# 3. gpu_check.py (placement, agreement, speed on random models of real shapes) with the current code;
# 4. tests/native with the default model, then the re-selection / chat / .kvc tests, on the GPU build.
# SMALL=1 shrinks every step, to try the script on a CPU build before a lease.
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT/g"
exec > >(tee -a "$OUT/main.log") 2>&1
date -u; uptime
source benchmarks/gpu/device_env.sh || exit 1
cd "$G/src"
TOK=7500; DEC=128; ROUNDS=3; N=48; T=1
[ "${SMALL:-0}" = 1 ] && { TOK=1500; DEC=8; ROUNDS=1; N=8; T=0.3; }
kv() { python3 -m kvcli.cli "$@"; }      # (timeout runs programs: there, python3 -m kvcli.cli)
lim() { python3 -c "print(int($1*$T)+5)"; }     # a step's time limit in seconds, shrunk by SMALL=1
s() { date +%s.%N; }
el() { python3 -c "print(f'{$(s) - $1:.1f} s')"; }

echo "== 1. answers on the real model, on the GPU (the same commands on a CPU are run where the CPU is: compare)"
t=$(s)
{ kv info
  for p in full "snapkv --budget 256"; do
      echo "--- run $p station-log"
      timeout $(lim 60) python3 -m kvcli.cli run --doc examples/station-log.txt --policy $p \
          -n $N --json "What is the locker number of the lower lake?"; echo "exit $?"
      echo "--- run $p solar-garden"
      timeout $(lim 60) python3 -m kvcli.cli run --doc examples/solar-garden.txt --policy $p \
          -n $N --json "Summarise this."; echo "exit $?"
  done
  echo "--- chat snapkv 256 re-selected, 3 piped questions"
  printf 'What is the locker number of the lower lake?\nWho cooked on day 18?\nHow strong was the wind on day 10?\n' |
      timeout $(lim 120) python3 -m kvcli.cli chat --doc examples/station-log.txt \
          --policy snapkv --budget 256 -n 24; echo "exit $?"
} > "$OUT/answers.txt" 2>&1
echo "answers in $(el $t):"; grep -E '^(---|exit)' "$OUT/answers.txt" | paste - - | head
echo "== 2. native_decode.py on the real model"
t=$(s)
timeout $(lim 150) python3 benchmarks/native_decode.py --tokens $TOK --budget 256 \
    --decode $DEC --rounds $ROUNDS --json-out "$OUT/native_decode.json" 2>&1 | tail -15
echo "native_decode: exit ${PIPESTATUS[0]} in $(el $t)"

echo "== 3. gpu_check.py"
t=$(s)
L=8192,32768; [ "${SMALL:-0}" = 1 ] && L=1024
timeout $(lim 120) python3 benchmarks/gpu/gpu_check.py --out "$OUT/g" --lengths $L \
    2>&1 | grep -E "done in|placement|speed|Error|error" | cut -c1-400
echo "gpu_check: exit ${PIPESTATUS[0]} in $(el $t)"

echo "== 4. tests"
t=$(s)
timeout $(lim 170) python3 -m pytest -q -p no:cacheprovider tests/native --maxfail=30 \
    --tb=short > "$OUT/native-tests.txt" 2>&1
echo "tests/native: exit $? in $(el $t)"; tail -14 "$OUT/native-tests.txt"
t=$(s)
timeout $(lim 150) python3 -m pytest -q -p no:cacheprovider tests/test_reselect.py \
    tests/test_reselect_cli.py tests/test_chat.py tests/test_kvc.py --maxfail=30 --tb=short \
    > "$OUT/product-tests.txt" 2>&1
echo "product tests: exit $? in $(el $t)"; tail -14 "$OUT/product-tests.txt"
date -u
