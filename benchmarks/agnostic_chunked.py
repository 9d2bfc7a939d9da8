"""Compress-once chat read in one prefill and in chunks (issue #32: expected_attention and kvzip read in chunks): the
documents and questions of `kvcli eval chat` (exported by benchmarks/kvpress_chat.py export), each document given
to `kvcli chat --compress-once --chunk N` with its questions piped, per policy and chunk setting; scored as kvcli
eval chat scores (string_match_all on the planted value).

    .venv/bin/python benchmarks/kvpress_chat.py export --model qwen2.5-coder-0.5b --length 4096 --documents 2 \\
        --seed 1 --facts 6 --check benchmarks/results/eval-chat-qwen-4k-ea-once.json --out /tmp/docs.json
    nice -n 10 .venv/bin/python benchmarks/agnostic_chunked.py --docs /tmp/docs.json \\
        --policies expected_attention --budget 1024 --chunks 0,1024 --json-out FILE

Each (document, policy, chunk) is one fresh `kvcli chat` process (--threads 2, greedy, 16 new tokens, --json: a
line per answer). --chunk 0 is the one-prefill read (what `kvcli eval chat --modes once` measures, from a stored
document); --chunk N reads the document by bounded reading before the first question.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_one(doc: dict, model: str, policy: str, budget: int, chunk: int, threads: int) -> dict:
    from kvcli.evaluation.tasks import string_match_all  # noqa: PLC0415
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(doc["text"])
        path = f.name
    cmd = [sys.executable, "-m", "kvcli.cli", "chat", "--model", model, "--doc", path, "--policy", policy,
           "--budget", str(budget), "--compress-once", "--chunk", str(chunk), "--threads", str(threads),
           "-n", "16", "--json"]
    questions = "".join(q["asked"] + "\n" for q in doc["facts"])
    t0, load0 = time.time(), Path("/proc/loadavg").read_text().split()[:3]
    p = subprocess.run(cmd, input=questions, capture_output=True, text=True, cwd=ROOT)
    Path(path).unlink()
    row = {"doc": doc["doc"], "policy": policy, "budget": budget, "chunk": chunk, "wall_s": round(time.time() - t0, 1),
           "load_before": load0, "load_after": Path("/proc/loadavg").read_text().split()[:3],
           "command": " ".join(cmd[2:4] + ["..."] + cmd[6:])}
    if p.returncode != 0:
        row["error"] = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
        return row
    answers = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    row["answers"] = [{"question": q["question"], "expected": q["answer"], "answer": a.get("answer"),
                       "score": 100.0 * string_match_all(a.get("answer") or "", [q["answer"]])}
                      for q, a in zip(doc["facts"], answers)]
    row["stats_first"] = {k: v for k, v in answers[0].items() if k not in ("answer", "question")} if answers else {}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--docs", required=True)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--policies", default="expected_attention")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--chunks", default="0,1024")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", required=True)
    a = ap.parse_args()
    docs = json.loads(Path(a.docs).read_text())["documents"]
    out = {"docs": a.docs, "model": a.model, "budget": a.budget, "started_utc": time.strftime("%Y-%m-%d %H:%M:%S",
           time.gmtime()), "rows": [], "summary": {}}
    for policy in a.policies.split(","):
        for chunk in [int(c) for c in a.chunks.split(",")]:
            for doc in docs:
                row = run_one(doc, a.model, policy, a.budget, chunk, a.threads)
                out["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "answers"}), file=sys.stderr, flush=True)
                Path(a.json_out).write_text(json.dumps(out, indent=1) + "\n")
            scores = [x["score"] for r in out["rows"] if (r["policy"], r["chunk"]) == (policy, chunk)
                      for x in r.get("answers", [])]
            if len(scores) > 1:
                m = sum(scores) / len(scores)
                se = math.sqrt(sum((s - m) ** 2 for s in scores) / (len(scores) - 1) / len(scores))
                out["summary"][f"{policy} chunk {chunk}"] = {"score": round(m, 1), "se": round(se, 1),
                                                             "questions": len(scores)}
    Path(a.json_out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["summary"], indent=1))


if __name__ == "__main__":
    main()
