#!/usr/bin/env python3
"""How well the block index finds a question's chunk (issue #46): the rank, among a bounded store's chunks, of the
chunk that holds each planted fact by the index's page bounds (the first of its two steps,
kvcli/drivers/block_index.py), and whether the chunks a question streams (after the second step, the candidates'
real keys) hold it.

    kvcli compress --model qwen2.5-coder-0.5b --doc book.txt --store --policy snapkv --budget 1024 -o book.store
    python benchmarks/book_recall.py --store book.store --facts facts.json --budget 1024 -o recall.json

The store is opened as `kvcli chat --cache DIR` opens it; for every planted fact the question is rendered as chat's
first question is (the document, the question, the assistant's turn), its queries computed once over the store's
summary and every chunk scored. The first and last chunks are always streamed; the rank counts the chunks between.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_common import ROOT, fact_chunk_rank, machine, uptime


def main() -> None:
    import sys
    sys.path.insert(0, str(ROOT))
    from kvcli.apps.chat import Conversation
    from kvcli.drivers import block_index
    from kvcli.drivers.compress import resolve
    from kvcli.drivers.reselect_bounded import ChunkedStore
    from kvcli.models import resolve_model
    from kvcli.native.session import NativeSession

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--store", required=True)
    ap.add_argument("--facts", required=True)
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    model = resolve_model(a.model)
    store = ChunkedStore.open(a.store, model)
    s = NativeSession(model, n_ctx=0, n_threads=a.threads, n_seq=2)
    s.create_context(a.budget + store.chunk + 512, 2)
    conv = Conversation(s, store.meta["document"], compression=resolve(s.model_path, "snapkv", a.budget),
                        reselect=True, system=store.meta.get("system"))
    texts = [s.detokenize(store.tokens[c.first_token:c.first_token + c.n]) for c in store.chunks]
    select = block_index.default_select(a.budget, store.chunk)
    cfg = resolve(model, "snapkv", a.budget)
    rows = []
    for f in json.loads(Path(a.facts).read_text()):
        where = [i for i, t in enumerate(texts) if str(f["answer"]) in t]
        prompt = s.tokenize(conv.conversation_text(f["question"]))
        t0 = time.perf_counter()
        scores = store.index_scores(s, 0, prompt)
        seconds = time.perf_counter() - t0
        chosen = {c.first_token for c in store._choose(s, 0, prompt, cfg)[0]}
        rows.append({"question": f["question"], "answer": str(f["answer"]), "depth": f.get("depth"),
                     "chunks_holding_it": where, "rank": fact_chunk_rank(scores, where, len(store.chunks)),
                     "streamed": any(store.chunks[i].first_token in chosen for i in where),
                     "index_s": round(seconds, 3)})
        print(rows[-1], flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(a.threads),
           "uptime": uptime(), "store": a.store, "chunks": len(store.chunks), "select": select, "budget": a.budget,
           "candidates": block_index.CANDIDATES, "facts": rows, "found": sum(r["streamed"] for r in rows)}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    store.close()
    s.close()


if __name__ == "__main__":
    main()
