#!/usr/bin/env bash
# Issue #63's small fidelity sample (docs/results/real-text.md, "A small sample"): the real-text corpus built from
# installed Debian packages, then kvcli eval fidelity on four tuning documents (one a genre), the first 4,096 tokens
# of each compressed once and the next 64 scored teacher-forced against the full cache.
#
# Usage: benchmarks/real_text_sample.sh [OUT_DIR]       (default benchmarks/results/real-text)
# Needs: apt-get install -y --no-install-recommends bible-kjv bible-kjv-text python3.11-doc debian-policy gnu-standards
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/real-text}
KV=.venv/bin/kvcli
MODEL=${MODEL:-qwen2.5-coder-0.5b}
mkdir -p "$OUT"
$KV eval corpus build --model "$MODEL" --out "$OUT/corpus" -q | tee "$OUT/corpus.txt"
{ date -u; uptime; } > "$OUT/uptime-start.txt"
$KV eval fidelity --model "$MODEL" --threads 1 --corpus "$OUT/corpus" --split tune \
    --docs licence-lgpl-2.1,kjv-jonah-micah,man-hier,man-signal --policies full,snapkv,compresskv,kvzip \
    --budgets 256,1024 --lengths 4k --cont 64 --json-out "$OUT/fidelity-sample.json" | tee "$OUT/fidelity-sample.txt"
{ date -u; uptime; } > "$OUT/uptime-end.txt"
