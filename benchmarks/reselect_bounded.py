"""What bounded re-selection costs against exact re-selection (docs/results/chat-and-reselection.md, "Bounded
re-selection").

The documents and questions of `kvcli eval chat` (a generated logbook of about LENGTH tokens with six planted facts);
each question asked alone (question-aware, as `kvcli run --question` asks it) from one stored document: exact
(the full cache, kvcli/drivers/reselect.py) and bounded (stored chunk by chunk by bounded reading,
kvcli/drivers/reselect_bounded.py), same policy and budget. Scores are greedy and load-independent; seconds are
not: the JSON records `uptime`.

    .venv/bin/python benchmarks/reselect_bounded.py --model qwen2.5-coder-0.5b --length 8192 --documents 2 \
        --policy snapkv --budget 256 --chunk 1024 --out benchmarks/results/reselect-bounded-qwen-8k.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import time

from kvcli.drivers.reselect import StoredDocument, common_prefix
from kvcli.drivers.reselect_bounded import ChunkedStore
from kvcli.evaluation.chat import ask, make_chat_document, prefix_text, render
from kvcli.evaluation.tasks import string_match_all
from kvcli.generate import generate
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession
from kvcli.planning.planner import resolve


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--documents", type=int, default=2)
    ap.add_argument("--facts", type=int, default=6)
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model = resolve_model(a.model)
    s = NativeSession(model, n_ctx=0, n_seq=2)
    cfg = resolve(model, a.policy, a.budget)
    out = {"command": "benchmarks/reselect_bounded.py " + " ".join(f"--{k.replace('_', '-')} {v}"
                                                                      for k, v in vars(a).items() if v is not None),
           "uptime_start": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
           "model": os.path.basename(model), "records": []}
    for d in range(a.documents):
        text, planted, n_tok = make_chat_document(s, a.length, a.facts, seed=d)
        head = s.tokenize(prefix_text(s, text, agnostic=False))
        prompts = [s.tokenize(render(s, text, [], ask(f["question"]))) for f in planted]
        head = head[:min(common_prefix(head, p) for p in prompts)]
        n_ctx = -(-(n_tok + 512) // 256) * 256
        if s.ctx is None:
            s.create_context(n_ctx)
        else:
            s.clear()
            s.resize_context(n_ctx)
        stores = {}
        t0 = time.perf_counter()
        stores["exact"] = StoredDocument.read(s, head)
        stores["exact"].read_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        stores["bounded"] = ChunkedStore.read(s, head, cfg, a.chunk)
        stores["bounded"].read_s = time.perf_counter() - t0
        for form, store in stores.items():
            for i, (f, p) in enumerate(zip(planted, prompts)):
                r = store.reselect(s, p, cfg)
                g = generate(s, a.max_tokens)
                out["records"].append({"form": form, "doc": d, "question": i, "depth": f["depth"],
                                       "n_tokens": len(p), "answer_expected": f["answer"],
                                       "prediction": g.text.strip()[:60],
                                       "score": 100.0 * string_match_all(g.text, [f["answer"]]),
                                       "read_s": round(store.read_s, 2), "store_bytes": store.nbytes,
                                       **r.as_stats()})
                print(json.dumps(out["records"][-1]), flush=True)
            store.close()
    out["uptime_end"] = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    for form in ("exact", "bounded"):
        sc = [r["score"] for r in out["records"] if r["form"] == form]
        n = len(sc)
        mean = sum(sc) / n
        se = (sum((x - mean) ** 2 for x in sc) / (n - 1)) ** 0.5 / n ** 0.5 if n > 1 else 0.0
        out[form] = {"score": round(mean, 1), "se": round(se, 1), "questions": n}
        print(form, out[form], flush=True)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
