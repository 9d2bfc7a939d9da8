#!/usr/bin/env bash
# The README's single-question table (issue #33): one question (the second planted fact, the issue's) over a long
# document, the full cache read in one go against bounded reading at budget 256, on qwen2.5-coder-0.5b: prefill
# seconds, decode tok/s, peak RSS (the process's, from the OS: --json's peak_rss_bytes) and the answer.
# Run it alone on the machine (each row records uptime).
#   benchmarks/single_question.sh [16k|30k|all]      -> benchmarks/results/single-question-qwen.jsonl
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
OUT=benchmarks/results/single-question-qwen.jsonl
WHICH=${1:-all}
DOCS=$(mktemp -d)
trap 'rm -rf "$DOCS"' EXIT
row() {   # label doc question args...
    local label=$1 doc=$2 q=$3; shift 3
    echo "== $label ($(uptime))" >&2
    $PY -m kvcli.cli run --model qwen2.5-coder-0.5b --threads 2 --doc "$doc" -n 16 --json "$@" "$q" \
        | $PY -c "import json,sys; r=json.load(sys.stdin); r['label']=sys.argv[1]; r['uptime']=sys.argv[2]; \
print(json.dumps(r))" "$label" "$(uptime)" >> "$OUT"
    tail -1 "$OUT" | $PY -c "import json,sys; r=json.load(sys.stdin); s=r.get('stats',r); \
print({k: s.get(k) for k in ('prefill_s','decode_tok_s','peak_rss_bytes')}, repr(r.get('answer', r.get('text'))))" >&2
}
if [[ $WHICH == 16k || $WHICH == all ]]; then
    $PY examples/make_docs.py --tokens 16000 --facts 3 --seed 11 -o "$DOCS/d16k.txt" --facts-json "$DOCS/f16.json"
    Q=$($PY -c "import json,sys; f=json.load(open(sys.argv[1]))[1]; print(f['question'], '|', f['answer'], file=sys.stderr); print(f['question'])" "$DOCS/f16.json")
    row "16k full --chunk 0" "$DOCS/d16k.txt" "$Q" --policy full --chunk 0
    row "16k snapkv 256 (bounded)" "$DOCS/d16k.txt" "$Q" --policy snapkv --budget 256
    row "16k compresskv 256 (bounded)" "$DOCS/d16k.txt" "$Q" --policy compresskv --budget 256
fi
if [[ $WHICH == 30k || $WHICH == all ]]; then
    $PY examples/make_docs.py --tokens 31000 --facts 3 --seed 12 -o "$DOCS/d30k.txt" --facts-json "$DOCS/f30.json"
    Q=$($PY -c "import json,sys; f=json.load(open(sys.argv[1]))[1]; print(f['question'], '|', f['answer'], file=sys.stderr); print(f['question'])" "$DOCS/f30.json")
    row "30k snapkv 256 (bounded)" "$DOCS/d30k.txt" "$Q" --policy snapkv --budget 256
    row "30k full --chunk 0" "$DOCS/d30k.txt" "$Q" --policy full --chunk 0
fi
