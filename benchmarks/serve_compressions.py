#!/usr/bin/env python3
"""One question asked of one stored document under several compressions, through kvcli serve's per-request
"kvcli" field (issue #62: which compressions answer the question that snapkv @ 256 loses at 16k in every run of
benchmarks/serve_lengths.py).

    python benchmarks/serve_compressions.py --words 12000 --question 0 \
        -o benchmarks/results/serve-compressions-16k-radio-mast.jsonl

The server is started once (--policy snapkv --budget 256, the document's tokens + 2048 cells); its first request
reads the document (the server's own compression), then the same question again with each variant, then the other
questions with --others' compression. Answers only (seconds are printed but this is not a timing benchmark: a
column-sum policy such as d2o re-reads the whole document for its observation).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from serve_questions import free_port, post, wait_healthy  # noqa: E402

from kvcli.evaluation.logbook import make_document  # noqa: E402

VARIANTS = ([{"budget": b} for b in (128, 384, 512, 1024)]
            + [{"policy": p} for p in ("compresskv", "pyramidkv", "windowkv", "dynamickv", "spindlekv", "d2o", "full")]
            + [{"window_from": "policy"}])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--words", type=int, default=12000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--question", type=int, default=0, help="which of the document's six questions")
    ap.add_argument("--others", default="compresskv", help="the policy the other questions are asked with")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--out", type=Path)
    a = ap.parse_args()
    text, facts = make_document(a.words, facts=6, seed=a.seed)
    port = free_port()
    ctx = -(-(int(a.words * 1.32) + 2048) // 1024) * 1024
    cmd = [sys.executable, "-m", "kvcli.cli", "serve", "--model", a.model, "--policy", "snapkv", "--budget", "256",
           "--threads", str(a.threads), "--ctx", str(ctx), "--port", str(port), "--dry-multiplier", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "KVCLI_CACHE": tempfile.mkdtemp()},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_healthy(proc, port)
    rows = []

    def ask(fact: dict, ext: dict) -> None:
        body = {"model": a.model, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
                **({"kvcli": ext} if ext else {}),
                "messages": [{"role": "user", "content": f"{text}\n\n{fact['question']}"}]}
        secs, got = post(port, body)
        answer = got["choices"][0]["message"]["content"]
        rows.append({"kvcli": ext, "question": fact["question"], "expected": fact["answer"],
                     "right": fact["answer"] in answer, "seconds": round(secs, 2), "answer": answer.strip()})
        print(json.dumps(rows[-1]), flush=True)

    try:
        asked = facts[a.question]
        for ext in [{}] + VARIANTS:
            ask(asked, ext)
        for fact in facts:
            if fact is not asked:
                ask(fact, {"policy": a.others})
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    if a.out:
        a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    main()
