#!/usr/bin/env bash
# qwen2.5-coder-0.5b (491 MB) travels to a lent GPU in parts: one device call carries 64 MiB with the working tree,
# so the GGUF is cut into 48 MiB parts, each in a folder of its own that .git/info/exclude ignores:
#   here:   benchmarks/gpu/qwen_parts.sh split      -> .gpuq01/part01 ... .gpuqNN/partNN (+ .gpuqNN/model.sha256)
#   there:  one call per folder (carry it): mkdir -p /tmp/q && cp .gpuqNN/* /tmp/q/
# benchmarks/gpu/run_chat_grid.sh joins them (cat /tmp/q/part*) and checks the SHA-256.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ "${1:-}" = split ] || { echo "usage: $0 split" >&2; exit 2; }
SRC=$(.venv/bin/python -c "from kvcli.models import resolve_model; print(resolve_model('qwen2.5-coder-0.5b'))")
grep -qx '/.gpuq\*/' .git/info/exclude 2>/dev/null || echo '/.gpuq*/' >> .git/info/exclude
rm -rf .gpuq[0-9]* /tmp/qwen-parts && mkdir -p /tmp/qwen-parts
split -b 48M -d -a 2 "$SRC" /tmp/qwen-parts/part
n=0
for p in /tmp/qwen-parts/part*; do
    n=$((n + 1)); d=$(printf '.gpuq%02d' "$n"); mkdir -p "$d"; mv "$p" "$d/"
done
(cd "$(dirname "$SRC")" && sha256sum "$(basename "$SRC")" | sed 's/ .*/  qwen2.5-coder-0.5b.gguf/') > "$d/model.sha256"
rmdir /tmp/qwen-parts
du -sh .gpuq[0-9]* | tr '\n' ' '; echo
