"""How often the first cited passage holds the answer, in kvcli chat's exact and bounded re-selected forms, as
`kvcli chat --cite` cites (kvcli/citations.py cite_turn) (docs/results/citations.md).

A logbook (kvcli/evaluation/logbook.py, as examples/make_docs.py writes it) with N planted facts, each a line of
its own; every question asked alone (/reset between them) in each form:

    exact    the document's full cache stored, every question re-selected from it (kvcli chat's default below
             256 MiB of full cache)
    bounded  the document read once in chunks of --chunk tokens and stored as read, each question streaming the
             first, the last and the chunks its block index scores best (kvcli chat --chunk N; a book's form)

For each answer: is it right (it holds the planted value), is the planted sentence the first cited passage, is it
among the three cited, and (bounded) was its chunk among those streamed.

    python benchmarks/citations_forms.py --model qwen2.5-coder-0.5b --words 2400 --facts 12 --budget 256 \
        --chunk 256 --threads 1 --seeds 0,1 -o citations-forms.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from kvcli.apps.chat import Conversation
from kvcli.citations import cite_turn
from kvcli.doc_formats import Document
from kvcli.evaluation.logbook import make_document
from kvcli.generate import Sampler, Sampling
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--words", type=int, default=2400)
    ap.add_argument("--facts", type=int, default=12)
    ap.add_argument("--seeds", default="0", help="logbooks, one per seed (comma-separated)")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256, help="the bounded form's chunk (kvcli chat --chunk N)")
    ap.add_argument("--forms", default="bounded,exact")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("-o", "--out", default=None, help="JSON lines, one per answer, written as they come")
    a = ap.parse_args()
    session = NativeSession(resolve_model(a.model), n_ctx=0, n_threads=a.threads)
    sampler = Sampler(Sampling())   # the CLI's defaults (greedy + DRY)
    rows = []
    out = open(a.out, "w") if a.out else None
    for seed in [int(x) for x in a.seeds.split(",")]:
        text, facts = make_document(a.words, a.facts, seed=seed)
        doc = Document(text, "text", "logbook")
        for form in a.forms.split(","):
            rows += one_form(a, session, sampler, form, seed, doc, facts, out)
    summary(rows)
    session.close()


def one_form(a, session, sampler, form: str, seed: int, doc: Document, facts: list, out) -> list:
    session.clear()
    conv = Conversation(session, doc.text, policy=a.policy, budget=a.budget, reselect=True,
                        chunk=a.chunk if form == "bounded" else None)
    conv.source = doc
    conv.store_turns = False
    t0 = time.perf_counter()
    conv.read_store()
    assert conv.store.bounded == (form == "bounded"), form
    read_s = time.perf_counter() - t0
    print(f"[{form}, seed {seed}] {len(conv.prefix_tokens)} tokens read in {read_s:.1f}s"
          + (f", {len(conv.store.chunks)} chunks of {conv.store.chunk}" if conv.store.bounded else ""),
          file=sys.stderr, flush=True)
    rows = []
    for f in facts:
        if conv.turns:
            conv.reset()
        t1 = time.perf_counter()
        gen = conv.ask(f["question"], a.max_tokens, sampler)
        t2 = time.perf_counter()
        cited = cite_turn(conv, gen)
        cite_s = time.perf_counter() - t2
        hits = [f["sentence"] in doc.text[c.start:c.end] for c in cited.passages]
        r = conv.last_reselection
        row = {"form": form, "seed": seed, "question": f["question"], "answer": gen.text,
               "right": f["answer"] in gen.text, "first": bool(hits and hits[0]), "top3": any(hits),
               "ask_s": round(t2 - t1, 3), "cite_s": round(cite_s, 3), "note": cited.note,
               "tokens": len(conv.prefix_tokens), "cited": cited.as_json()}
        if conv.store.bounded:
            at = doc.text.index(f["sentence"])
            row.update(streamed=r.streamed, stored=len(conv.store.chunks),
                       fact_chunk=_chunk_of(conv, at), read_s=round(read_s, 2))
            row["fact_streamed"] = row["fact_chunk"] in r.streamed
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("form", "seed", "question", "answer", "right", "first", "top3",
                                                  "fact_streamed", "ask_s", "cite_s")}), file=sys.stderr, flush=True)
        if out is not None:
            out.write(json.dumps(row) + "\n")
            out.flush()
    conv.close()
    return rows


def _chunk_of(conv, char: int) -> int | None:
    """The stored chunk whose tokens hold the document's character `char` (its prompt's pieces placed)."""
    from kvcli import citations   # noqa: PLC0415
    pieces = citations.token_pieces(conv.session, conv.prefix_tokens)
    text = conv.prefix_text()
    at = text.find(conv.document.strip()) + char - (len(conv.document) - len(conv.document.lstrip()))
    offs = citations.token_offsets(pieces, text)
    tok = int((offs <= at).sum()) - 1
    for i, c in enumerate(conv.store.chunks):
        if c.first_token <= tok < c.first_token + c.n:
            return i
    return None


def summary(rows: list) -> None:
    for form in dict.fromkeys(r["form"] for r in rows):
        rs = [r for r in rows if r["form"] == form]
        right = [r for r in rs if r["right"]]
        line = (f"{form}: {len(right)}/{len(rs)} right; first cited passage holds the answer in "
                f"{sum(r['first'] for r in right)}/{len(right)} right answers ({sum(r['first'] for r in rs)}/{len(rs)} "
                f"of all), among the three cited in {sum(r['top3'] for r in right)}/{len(right)} "
                f"({sum(r['top3'] for r in rs)}/{len(rs)} of all)")
        if any("fact_streamed" in r for r in rs):
            line += f"; the fact's chunk streamed for {sum(r['fact_streamed'] for r in rs)}/{len(rs)}"
        print(line)
        cs = sorted(r["cite_s"] for r in rs)
        print(f"  cite_s median {cs[len(cs) // 2]:.2f} ({cs[0]:.2f}-{cs[-1]:.2f}); ask_s median "
              f"{sorted(r['ask_s'] for r in rs)[len(rs) // 2]:.2f}")


if __name__ == "__main__":
    main()
