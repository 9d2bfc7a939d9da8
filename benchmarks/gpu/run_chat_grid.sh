#!/usr/bin/env bash
# Issue #30's multi-question grid (and issue #32's 8k RULER rounds) on a lent GPU, on qwen2.5-coder-0.5b, after
# benchmarks/gpu/pack.sh packed .gpu/ and benchmarks/gpu/qwen_parts.sh's parts were carried into /tmp/q:
#   T=480 bash benchmarks/gpu/run_chat_grid.sh          (from the repo root; results under $OUT)
# On an H100 (2026-11-26) one evaluation process did little in 400 s: the GPU's prefill is fast, but the host-side
# work of each configuration (planning, kvzip's passes, Python) is serial. So every (policy, length) is a process
# of its own, all started at once on the machine's 16 cores, each with one thread (its layers are on the GPU); each
# is stopped by SIGINT at T seconds and keeps what it scored (an interrupted `kvcli eval` writes its JSON; a mode
# cut short loses that mode's records only). Documents and seeds are the CPU tables' (4k: seed 1, 8k and 16k:
# seed 0), so the scores sit beside them; snapkv runs at 4k and 8k too, to compare the GPU's greedy answers with
# the CPU's on the same documents. RULER=1 adds #32's 8k rounds (question-aware and -agnostic, seeds 0-3, the
# depths of benchmarks/results/ruler-agnostic-qwen-8k-r*.json).
# LAYOUTS=1 adds #32's comparison of answer layouts at 8k, budget 1024, on the ten documents of the kvpress
# comparison (seeds 0-4, documents 0 and 1, one process each): kvzip, snapkv and expected_attention in the modes
# once, alone and context, and kvzip with kvpress's parameters (alloc=global, recent=0) in context. GRID=0 leaves
# out the grid above. VARIANTS=1: kvzip with alloc=global, and with recent=0, alone (once, context; the same
# documents). EA16=1 adds expected_attention's second 16k document (reselect, run: #30's grid).
# SMALL=1 MODEL=GGUF tries the script on this machine's CPU build before a lease (with POLICIES, LENGTHS and a
# short T: e.g. POLICIES=h2o LENGTHS=4k T=60).
# Returns: $OUT/main.log, $OUT/results.tar.gz (every JSON), $OUT/logs.tar.gz (each process's stderr).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT/j" "$OUT/l"
exec > >(tee -a "$OUT/main.log") 2>&1
date -u; uptime
if [ "${SMALL:-0}" = 1 ]; then
    M=${MODEL:?MODEL: the GGUF}; KV=(.venv/bin/python -m kvcli.cli)
else   # (device_env.sh also takes a warm machine's earlier set-up when .gpu/ did not travel with this call)
    source benchmarks/gpu/device_env.sh || exit 1
    M=/tmp/q/qwen2.5-coder-0.5b.gguf
    cat /tmp/q/part* > $M && (cd /tmp/q && sha256sum -c model.sha256) || exit 1
    rm -f /tmp/q/part*
    cd "$SRC"; KV=(python3 -m kvcli.cli)
fi
T=${T:-480}
POL=${POLICIES:-dynamickv h2o streamingllm kvzip windowkv d2o spindlekv expected_attention}
LENS=${LENGTHS:-4k 8k 16k}
go() {   # name, then the eval's arguments: one background process stopped by SIGINT at T seconds
    local name=$1; shift
    timeout -s INT -k 30 "$T" "${KV[@]}" eval "$@" --threads 1 --json-out "$OUT/j/$name.json" \
        > "$OUT/l/$name.out" 2> "$OUT/l/$name.err" &
}
[ "${GRID:-1}" = 1 ] && for L in $LENS; do
    seed=0; [ "$L" = 4k ] && seed=1
    for P in $POL $([ "$L" != 16k ] && echo snapkv); do
        go "chat-$L-$P" chat --model $M --policies $P --budgets 128,256,512 --lengths $L --documents 2 --facts 6 \
            --modes full,once,reselect,run --seed $seed
    done
done
if [ "${LAYOUTS:-0}" = 1 ]; then
    LL=${LAYOUT_LENGTH:-8k}
    for S in 0 1 2 3 4; do
        for D in 0 1; do
            go "layouts-$LL-s$S-d$D" chat --model $M --policies kvzip,snapkv,expected_attention --budgets 1024 \
                --lengths $LL --documents 1 --from-document $D --seed $S --facts 6 --modes once,alone,context
            go "layouts-kvpress-params-$LL-s$S-d$D" chat --model $M --policies kvzip --budgets 1024 --lengths $LL \
                --documents 1 --from-document $D --seed $S --facts 6 --modes context \
                --policy-arg kvzip.alloc=global --policy-arg kvzip.recent=0
        done
    done
fi
if [ "${VARIANTS:-0}" = 1 ]; then   # #32: which of kvpress's two parameters moves kvzip's score (once, context)
    for S in 0 1 2 3 4; do
        for D in 0 1; do
            for V in alloc=global recent=0; do
                go "variant-${V/=/-}-8k-s$S-d$D" chat --model $M --policies kvzip --budgets 1024 --lengths 8k \
                    --documents 1 --from-document $D --seed $S --facts 6 --modes once,context --policy-arg kvzip.$V
            done
        done
    done
fi
if [ "${EA16:-0}" = 1 ]; then   # #30's expected_attention 16k cells left at one document: its second one
    go chat-16k-expected_attention-d1 chat --model $M --policies expected_attention --budgets 128,256,512 \
        --lengths 16k --documents 1 --from-document 1 --seed 0 --facts 6 --modes reselect,run
fi
if [ "${RULER:-0}" = 1 ]; then
    depth=(0.25 0.75 0.5 0.1)
    for r in 0 1 2 3; do
        for mode in aware agnostic; do
            go "ruler-$mode-8k-r$r" ruler --model $M --policies full,snapkv,h2o,streamingllm,kvzip,expected_attention \
                --budgets 256,512,1024,2048 --lengths 8k --tasks niah_single,niah_multikey --depths ${depth[$r]} \
                --samples 1 --seed $r $([ $mode = agnostic ] && echo --agnostic)
        done
    done
fi
echo "$(jobs -p | wc -l) processes started $(date -u +%T)"
while [ -n "$(jobs -pr)" ]; do     # GPU memory and load every 30 s while they run
    sleep 30
    echo "$(date -u +%T) running $(jobs -pr | wc -l) | load $(cut -d' ' -f1 /proc/loadavg) |" \
         "$(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null)"
done
wait $(jobs -p) 2>/dev/null    # (a bare `wait` would also wait for the tee above, which never ends)
date -u
for f in "$OUT"/l/*.err; do     # each process's last progress line
    printf '%-34s %s\n' "$(basename "$f" .err)" "$(grep -E '^(\s+(full|once|alone|context|reselect|run)|\[)' "$f" | tail -1 | cut -c1-150)"
done
ls "$OUT/j" | wc -l
tar -czf "$OUT/results.tar.gz" -C "$OUT" j && tar -czf "$OUT/logs.tar.gz" -C "$OUT" l && rm -rf "$OUT/j" "$OUT/l"
ls -la "$OUT"
