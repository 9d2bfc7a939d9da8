#!/usr/bin/env python3
"""Does the block index stream the chunk that holds a question's evidence? Corpus documents (issue #63).

Each document of the corpus part is read once by bounded reading as `kvcli chat` reads it (runner.read_store_as_chat,
--policy at --budget; --stores keeps the reads for a second run), and for each of its questions (the corpus's, not
the summary) the chunks holding the evidence are found (the question's `depth`, or a combine question's two
`depths`, as characters of the document, mapped through the chunks' own text) and the index's choice is recorded:

    index     what kvcli chat streams (reselect_bounded.ChunkedStore.ranked, whose best _choose streams;
              kvcli/drivers/block_index.py: the question's queries, the middle half of the layers, each chunk scored
              by how far it stands out);
    first     the index as it was first made, replayed here on the same read: the prompt's last 32 tokens as the
              probe, every layer, each chunk scored by its summed softmax share, the page bounds' best 4 x select
              chunks rescored by their real keys.

Recorded per question: the evidence chunks, their rank by each scoring's final step, whether every evidence chunk
was streamed; pooled per form with its binomial standard error. No answer is generated: this measures the index's
retrieval, model by model, not the answers (kvcli eval corpus ask --mode bounded does that).

    python benchmarks/index_recall.py --corpus corpus/ --split heldout --min-doc-tokens 28000 \
        -o benchmarks/results/real-text/index-recall-heldout-0.5b.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from bench_common import ROOT, machine, uptime
from index_scoring import score

sys.path.insert(0, str(ROOT))

from kvcli.drivers import block_index  # noqa: E402
from kvcli.drivers.chunked import DEFAULT_CHUNK, pad_cells, question_probe  # noqa: E402
from kvcli.drivers.chunked_store import _snapshot_of  # noqa: E402
from kvcli.drivers.compress import resolve  # noqa: E402
from kvcli.drivers.reselect_bounded import ChunkedStore  # noqa: E402
from kvcli.evaluation.corpus import corpus_documents, load_manifest  # noqa: E402
from kvcli.evaluation.corpus_eval import doc_questions  # noqa: E402
from kvcli.evaluation.questions import KINDS  # noqa: E402
from kvcli.evaluation.runner import TURN_ROOM, read_store_as_chat  # noqa: E402
from kvcli.evaluation.tasks import prefix_text, render  # noqa: E402
from kvcli.models import resolve_model  # noqa: E402
from kvcli.native.session import NativeSession  # noqa: E402
from kvcli.native.state import chunk_keys  # noqa: E402

FORMS = ("index", "first")


def evidence_chunks(q, text: str, head_chars: int, bounds: list[int]) -> list[int]:
    """The chunks holding the question's evidence: its depths (fractions of the document's characters) placed in
    the stored prompt's text (`head_chars` of template before the document) against the chunks' cumulative ends."""
    depths = q.meta.get("depths") or [q.depth]
    lead = len(text) - len(text.lstrip())            # the stored prompt holds the document stripped
    out = []
    for d in depths:
        at = head_chars + max(int(d * len(text)) - lead, 0)
        out.append(next(i for i, end in enumerate(bounds) if at < end))
    return sorted(set(out))


def first_choice(store, session, prompt: list[int], select: int) -> tuple[list[int], list[int]]:
    """(chunks streamed, indices among all chunks, ascending; the final step's ranking of the inner chunks, best
    first) by the index as it was first made (kvcli 2026-12-06, before the question's queries and z scores)."""
    def shares(maxima):
        return score(np.stack(maxima), "share")

    session.restore_seq(_snapshot_of(store.summary, store._read_file(store.summary)), 0)
    try:
        q = block_index.question_queries(session, 0, question_probe(prompt, 1, store.chunk), at=store.cap)
    finally:
        session.clear(0)
    info = session.info
    pages = shares([block_index.chunk_maxima(q, *block_index.load_pages(store._read_file(f), info))
                    for f in store.pages[1:-1]])
    cands = block_index.choose(pages, 4 * select)
    keys = shares([block_index.key_maxima(q, chunk_keys(store._read_chunk(store.chunks[1 + i]), info.n_head_kv)[0])
                   for i in cands])
    ranked = [cands[j] + 1 for j in (-keys).argsort(kind="stable")]
    best = sorted(cands[j] for j in block_index.choose(keys, select))
    return [0] + [1 + i for i in best] + [len(store.chunks) - 1], ranked


def index_choice(store, session, prompt: list[int], select: int) -> tuple[list[int], list[int]]:
    """(chunks streamed, the final step's ranking of the inner chunks) by kvcli chat's index (ChunkedStore.ranked,
    the two steps ChunkedStore._choose streams the best of)."""
    cands, keys = store.ranked(session, 0, prompt, select)
    ranked = [cands[j] + 1 for j in (-keys).argsort(kind="stable")]
    best = sorted(cands[j] for j in block_index.choose(keys, select))
    return [0] + [1 + i for i in best] + [len(store.chunks) - 1], ranked


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--split", default="heldout", choices=["tune", "heldout", "all"])
    ap.add_argument("--docs", default=None, help="comma-separated document ids")
    ap.add_argument("--min-doc-tokens", type=int, default=28000)
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--stores", default=None, help="keep each read in DIR/<doc>; open it when it exists")
    ap.add_argument("-o", "--out", required=True)
    a = ap.parse_args()
    model = resolve_model(a.model)
    docs, meta = corpus_documents(a.corpus, a.split, None, None, a.docs, a.min_doc_tokens)
    formats = {d["id"]: d["format"] for d in load_manifest(a.corpus)["documents"]}
    s = NativeSession(model, n_ctx=pad_cells(DEFAULT_CHUNK), n_threads=a.threads, n_seq=2)
    cfg = resolve(model, a.policy, a.budget)
    rows, reads = [], {}
    try:
        for d in docs:
            qs = doc_questions(d, formats, a.per_kind, KINDS)
            head_text = prefix_text(s, d.text, False)
            t0 = time.perf_counter()
            saved = Path(a.stores) / d.name if a.stores else None
            if saved and saved.exists():
                store = ChunkedStore.open(saved, model)
                s.resize_context(pad_cells(cfg.budget + store.chunk + TURN_ROOM), 2)
            else:
                store, _ = read_store_as_chat(s, s.tokenize(head_text), cfg)
                if saved:
                    store.save_as(saved, s)
            reads[d.name] = round(time.perf_counter() - t0, 1)
            try:
                texts = [s.detokenize(store.tokens[c.first_token:c.first_token + c.n]) for c in store.chunks]
                bounds = [sum(len(t) for t in texts[:i + 1]) for i in range(len(texts))]
                head_chars = head_text.index(d.text.strip()[:200])
                select = store.chunks_per_question(cfg.budget)
                for i, q in enumerate(qs):
                    if q.kind == "summary":
                        continue
                    where = evidence_chunks(q, d.text, head_chars, bounds)
                    prompt = s.tokenize(render(s, d.text, [], q.question))
                    row = {"doc": d.name, "genre": meta.get(d.name, {}).get("genre"), "question": i, "kind": q.kind,
                           "evidence_chunks": where, "chunks": len(store.chunks), "select": select}
                    for form in FORMS:
                        chosen, ranked = (index_choice(store, s, prompt, select) if form == "index" else
                                          first_choice(store, s, prompt, select))
                        row[form] = {"streamed": chosen, "hit": all(c in chosen for c in where),
                                     "ranks": [0 if c in (0, len(store.chunks) - 1) else
                                               (ranked.index(c) + 1 if c in ranked else None) for c in where]}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                store.close()
    finally:
        s.close()
    summary = {}
    for form in FORMS:
        hits = [r[form]["hit"] for r in rows]
        p = sum(hits) / len(hits) if hits else None
        summary[form] = {"questions": len(hits), "evidence_streamed": p,
                         "se": math.sqrt(p * (1 - p) / len(hits)) if hits else None}
    out = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": machine(a.threads),
           "uptime": uptime(), "model": a.model, "policy": a.policy, "budget": a.budget, "argv": sys.argv[1:],
           "candidates": block_index.CANDIDATES, "read_s": reads, "rows": rows, "summary": summary}
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
