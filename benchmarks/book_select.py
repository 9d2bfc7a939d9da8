#!/usr/bin/env python3
"""What the block index streams per question, and what streaming more chunks buys (issue #46, budget 256).

One logbook, the one `kvcli eval chat --lengths L --seed S --facts 6` makes, is read once by bounded reading as kvcli
chat reads it (eval chat's bounded mode); then its six questions are asked in one conversation for each number of
chosen chunks in --selects (the store's `select`: KVCLI_RESELECT_CHUNKS's meaning), each answer recorded with the rank,
by the index, of the chunk that holds its fact (0: the first or last chunk, always streamed; None: the answer's
digits straddle two chunks). A wrong answer whose chunk was streamed was lost in the re-selection; one whose chunk
was not, by the index.

    python benchmarks/book_select.py --length 64k --budget 256 --selects 6,12,24 -o results/book-select-64k-b256.json
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_common import ROOT, fact_chunk_rank, machine, uptime


def tokens(s: str) -> int:
    return int(s[:-1]) * 1024 if s.lower().endswith("k") else int(s)


def main() -> None:
    import sys
    sys.path.insert(0, str(ROOT))
    from kvcli.drivers.chunked import DEFAULT_CHUNK, pad_cells
    from kvcli.drivers.compress import resolve
    from kvcli.evaluation.chat import ask, make_chat_document
    from kvcli.evaluation.measure import peak_rss_bytes
    from kvcli.drivers import block_index
    from kvcli.drivers.reselect_bounded import ChunkedStore
    from kvcli.evaluation.runner import TURN_ROOM, _greedy, read_store_as_chat
    from kvcli.evaluation.tasks import prefix_text, render, string_match_all
    from kvcli.models import resolve_model
    from kvcli.native.session import NativeSession

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--length", default="64k")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--selects", default="6,12,24")
    ap.add_argument("--facts", type=int, default=6)
    ap.add_argument("--seed", type=int, default=46)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--store", default=None, help="keep the read in this folder; open it when it exists")
    ap.add_argument("--candidates", type=int, default=None,
                    help="chunks scored by their real keys per chunk streamed (block_index.CANDIDATES; 1: the page "
                         "bounds alone choose)")
    ap.add_argument("--exact", action="store_true",
                    help="also rank the chunks by their real keys' largest logits (the bounds' exact counterpart)")
    ap.add_argument("--one-at-a-time", action="store_true",
                    help="compact after every chosen chunk (budget + one chunk, a probe each), as every chunk is")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    model = resolve_model(a.model)
    if a.candidates is not None:
        block_index.CANDIDATES = a.candidates
    length = tokens(a.length)
    tok = NativeSession(model, n_ctx=0, n_threads=a.threads)
    text, planted, n_tok = make_chat_document(tok, length, a.facts, a.seed * 1000)
    tok.close()
    s = NativeSession(model, n_ctx=pad_cells(min(length, DEFAULT_CHUNK)), n_threads=a.threads, n_seq=2)
    cfg = resolve(model, a.policy, a.budget)
    t0 = time.perf_counter()
    if a.store and Path(a.store).exists():
        store = ChunkedStore.open(a.store, model)
        s.resize_context(pad_cells(cfg.budget + store.chunk + TURN_ROOM), 2)
    else:
        store, _ = read_store_as_chat(s, s.tokenize(prefix_text(s, text, False)), cfg)
        if a.store:
            store.save_as(a.store, s)
    read_s = time.perf_counter() - t0
    print(f"read {n_tok} tokens in {read_s:.1f} s, {len(store.chunks)} chunks", flush=True)
    texts = [s.detokenize(store.tokens[c.first_token:c.first_token + c.n]) for c in store.chunks]
    rows = []
    for select in [int(x) for x in a.selects.split(",")]:
        store.select = select
        history = []
        for i, fact in enumerate(planted):
            q = ask(fact["question"])
            prompt = s.tokenize(render(s, text, history, q))
            where = [j for j, t in enumerate(texts) if str(fact["answer"]) in t]
            rank = fact_chunk_rank(store.index_scores(s, 0, prompt), where, len(texts))
            exact_rank = None
            if a.exact:   # the same scoring with every chunk's real keys in place of the page bounds
                exact = store.key_scores(store.question_queries(s, 0, prompt), s.info, list(range(len(texts) - 2)))
                exact_rank = fact_chunk_rank(exact, where, len(texts))
            chosen = {c.first_token for c in store._choose(s, 0, prompt, cfg)[0]}
            r = store.reselect(s, prompt, cfg, cells=cfg.budget + store.chunk if a.one_at_a_time else None)
            answer = _greedy(s, s.logits(0), 12)
            rows.append({"select": select, "question": i, "depth": fact["depth"], "expected": fact["answer"],
                         "prediction": answer.strip()[:40], "right": bool(string_match_all(answer, [fact["answer"]])),
                         "fact_chunk_rank": rank, "exact_rank": exact_rank,
                         "streamed": any(store.chunks[j].first_token in chosen for j in where),
                         "reselect_s": round(r.total_s, 3), "index_s": round(r.index_s, 3), "chunks": r.chunks})
            print(rows[-1], flush=True)
            history.append((q, answer.strip()))
            s.clear(0)
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(a.threads),
           "uptime": uptime(), "model": a.model, "policy": a.policy, "budget": a.budget, "doc_tokens": n_tok,
           "seed": a.seed, "one_at_a_time": a.one_at_a_time, "candidates": block_index.CANDIDATES,
           "chunks": len(store.chunks), "read_s": round(read_s, 1), "rows": rows,
           "right": {sel: sum(r["right"] for r in rows if r["select"] == sel) for sel in {r["select"] for r in rows}},
           "peak_rss_bytes": peak_rss_bytes()}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    store.close()
    s.close()


if __name__ == "__main__":
    main()
