#!/usr/bin/env bash
# Peak RSS of re-selection against bounded reading on one document (issue #30: "bounded re-selection at 16k tokens
# peaks within 10% of bounded reading's peak"): qwen2.5-coder-0.5b, a generated logbook of TOKENS tokens with three
# planted facts, snapkv at budget 256, three processes one after the other:
#   run     kvcli run, the first question (bounded reading: the default above 64 MiB of full cache)
#   bounded kvcli chat --chunk 1024, the three questions (bounded re-selection, chunks as bounded reading reads)
#   exact   kvcli chat --chunk 0, the three questions (exact re-selection: the full cache held while re-selecting)
# Each process's peak RSS as the OS reports it (/usr/bin/time -v "Maximum resident set size", and the JSON's
# peak_rss_bytes), next to its KV buffer. Writes benchmarks/results/reselect-memory-qwen-TOKENS.json.
set -euo pipefail
cd "$(dirname "$0")/.."
TOKENS=${TOKENS:-16000}
K=.venv/bin/kvcli
W=$(mktemp -d)
.venv/bin/python examples/make_docs.py --tokens "$TOKENS" --facts 3 --seed 21 -o "$W/doc.txt" --facts-json "$W/facts.json"
.venv/bin/python -c "import json,sys; [print(f['question'] + ' Answer with the number only.') for f in json.load(open(sys.argv[1]))]" "$W/facts.json" > "$W/qs.txt"
M="--model qwen2.5-coder-0.5b --doc $W/doc.txt --policy snapkv --budget 256 --threads 2 -n 16 --json"
up0=$(uptime)
/usr/bin/time -v $K run $M "$(head -1 "$W/qs.txt")" > "$W/run.json" 2> "$W/run.err"
/usr/bin/time -v $K chat $M --fresh --chunk 1024 < "$W/qs.txt" > "$W/bounded.jsonl" 2> "$W/bounded.err"
/usr/bin/time -v $K chat $M --fresh --chunk 0 < "$W/qs.txt" > "$W/exact.jsonl" 2> "$W/exact.err"
up1=$(uptime)
.venv/bin/python - "$W" "$TOKENS" "$up0" "$up1" <<'PY'
import json, re, sys
from pathlib import Path
w, tokens, up0, up1 = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
facts = json.loads((w / "facts.json").read_text())
def maxrss(name):
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", (w / f"{name}.err").read_text())
    return int(m.group(1)) * 1024
out = {"document": f"python examples/make_docs.py --tokens {tokens} --facts 3 --seed 21", "uptime_start": up0,
       "uptime_end": up1, "command": "benchmarks/reselect_memory.sh", "runs": {}}
run = json.loads((w / "run.json").read_text())
out["runs"]["run (bounded reading)"] = {"peak_rss_bytes": maxrss("run"), "answers": [run["answer"]],
                                        "stats": run.get("stats")}
for name in ("bounded", "exact"):
    rows = [json.loads(l) for l in (w / f"{name}.jsonl").read_text().splitlines() if l.strip()]
    summary = [l for l in (w / f"{name}.err").read_text().splitlines() if l.startswith("[")]
    out["runs"][f"chat ({name} re-selection)"] = {"peak_rss_bytes": maxrss(name), "summary": summary[:1],
                                                   "answers": [r["answer"] for r in rows], "rows": rows}
out["expected"] = [str(f["answer"]) for f in facts]
p = Path(f"benchmarks/results/reselect-memory-qwen-{int(tokens) // 1000}k.json")
p.write_text(json.dumps(out, indent=1) + "\n")
for k, v in out["runs"].items():
    print(f"{k}: peak RSS {v['peak_rss_bytes'] / 1e9:.2f} GB; answers {v['answers']}")
print("expected", out["expected"])
PY
