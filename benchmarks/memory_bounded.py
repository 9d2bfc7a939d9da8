"""Peak memory of a question-agnostic policy read by bounded reading against snapkv's, same document and budget
(issue #32's must-show: "kvzip's peak RSS with bounded reading within 10% of snapkv's for the same document";
expected_attention measured the same way).

    python benchmarks/memory_bounded.py DOC --model qwen2.5-coder-0.5b [--policies kvzip,expected_attention]
        [--budget 256] [--chunk 1024] [--one-prefill] [--json-out FILE]

Runs, each a fresh `kvcli run` process under `/usr/bin/time -f %M` (the kernel's maximum resident set) beside the
`peak_rss_bytes` (VmHWM) of its own --json stats: snapkv --chunk N, then each policy --chunk N (kvzip with its
reconstruction pass chunk by chunk, expected_attention with each chunk's query statistics), and with --one-prefill
each policy --chunk 0 (one prefill) for scale. RSS does not depend on the machine's load; the times do (the JSON
keeps them with the load).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from bench_common import ROOT, run_max_rss
STATS = ("peak_rss_bytes", "kv_bytes_allocated", "kv_cells_allocated", "peak_kv_cells", "cache_cap", "kv_cells",
         "prompt_tokens", "chunks", "chunk", "chunk_scoring", "prefill_s", "compress_s", "reconstruct_s")


def measure(doc: Path, model: str, question: str, args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "kvcli.cli", "run", "--model", model, "--doc", str(doc), "-n", "16", "--json",
           "--quiet", *args, question]
    t0 = time.time()
    r, max_rss = run_max_rss(cmd, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    row = {"command": f"kvcli run --model {model} --doc {doc.name} -n 16 --json --quiet " + " ".join(args)
                      + f" '{question}'", "wall_s": round(time.time() - t0, 1),
           "load_after": os.getloadavg()}
    if r.returncode != 0:
        row["error"] = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return row
    out = json.loads(r.stdout)
    s = out["stats"]
    row["time_max_rss_bytes"] = max_rss
    row.update({k: s.get(k) for k in STATS})
    row["answer"] = out.get("answer", out.get("text"))
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("doc", type=Path)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--question", default="What is the locker number of the old quarry?")
    ap.add_argument("--policies", default="kvzip", help="comma-separated policies compared with snapkv")
    ap.add_argument("--one-prefill", action="store_true", help="also each policy with --chunk 0")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    b, c = str(a.budget), str(a.chunk)
    names = [p for p in a.policies.split(",") if p]
    runs = [("snapkv bounded", ["--policy", "snapkv", "--budget", b, "--chunk", c])]
    runs += [(f"{p} bounded", ["--policy", p, "--budget", b, "--chunk", c]) for p in names]
    if a.one_prefill:
        runs += [(f"{p} one prefill", ["--policy", p, "--budget", b, "--chunk", "0"]) for p in names]
    rows = []
    for label, args in runs:
        row = {"run": label, **measure(a.doc, a.model, a.question, args)}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    ok = {r["run"]: r for r in rows if "error" not in r}
    summary = {}
    for p in names:
        if {"snapkv bounded", f"{p} bounded"} <= ok.keys():
            for k in ("time_max_rss_bytes", "peak_rss_bytes"):
                summary[f"{p}_over_snapkv_{k}"] = round(ok[f"{p} bounded"][k] / ok["snapkv bounded"][k], 4)
    res = {"doc": str(a.doc), "model": a.model, "budget": a.budget, "chunk": a.chunk, "threads":
           os.environ.get("KVCLI_THREADS"), "rows": rows, "summary": summary}
    text = json.dumps(res, indent=1)
    if a.json_out:
        a.json_out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
