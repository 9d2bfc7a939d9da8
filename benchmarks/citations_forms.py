"""How often the first cited passage holds the answer, in kvcli chat's exact and bounded re-selected forms, as
`kvcli chat --cite` cites (kvcli/citations.py cite_turn) (docs/results/citations.md).

Two sources of questions whose answer is one stated passage:

- logbooks (kvcli/evaluation/logbook.py, as examples/make_docs.py writes them) with N planted facts, each a line of
  its own; right when the answer holds the planted value as a whole number; the citation holds the answer when its
  passage holds the planted sentence;
- the real-text corpus (`--corpus DIR`, built by `kvcli eval corpus build`, docs/results/real-text.md) with its
  single-fact questions (kvcli/evaluation/questions.py: `fact`, a sentence quoted with its one number blanked, and
  `copy`, with its one name blanked; the number or name occurs once in the document); right when questions.py
  scores the answer 1; the citation holds the answer when its passage holds that number or name.

Every question is asked alone (/reset between them) in each form:

    exact    the document's full cache stored, every question re-selected from it (kvcli chat's default below
             256 MiB of full cache; a corpus document past that is asked in the bounded form only)
    bounded  the document read once in chunks of --chunk tokens and stored as read, each question streaming the
             first, the last and the chunks its block index scores best (kvcli chat --chunk N; a book's form)

For each answer: is it right, is its passage the first cited, is it among the three cited, and (bounded) was its
chunk among those streamed.

    python benchmarks/citations_forms.py --model qwen2.5-coder-0.5b --words 2400 --facts 12 --budget 256 \
        --chunk 256 --threads 1 --seeds 0,1 -o citations-forms.jsonl
    python benchmarks/citations_forms.py --model qwen2.5-coder-0.5b --corpus corpus/ --split tune \
        --docs man-hier,iso-3166-1 --budget 1024 --chunk 512 --threads 1 -o citations-corpus.jsonl
    python benchmarks/citations_forms.py --summarize citations-corpus*.jsonl   # the counts of JSON lines written

A rate is printed with its standard error, sqrt(p(1-p)/n), and the 95% Wilson interval (a small n, a rate near 1).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from kvcli.apps.chat import Conversation
from kvcli.citations import cite_turn, passages
from kvcli.doc_formats import Document
from kvcli.evaluation.corpus import load_manifest, select, verify
from kvcli.evaluation.logbook import make_document
from kvcli.evaluation.questions import found, make_questions, score_answer
from kvcli.generate import Sampler, Sampling
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession
from kvcli.planning.planner import resolve


SINGLE_FACT = ("fact", "copy")   # the corpus's questions whose answer is one stated passage


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--words", type=int, default=2400)
    ap.add_argument("--facts", type=int, default=12)
    ap.add_argument("--seeds", default="0", help="logbooks, one per seed (comma-separated)")
    ap.add_argument("--corpus", default=None, metavar="DIR", help="the real-text corpus's documents and their "
                    "single-fact questions instead of logbooks (kvcli eval corpus build --out DIR)")
    ap.add_argument("--split", default="tune", choices=("tune", "heldout", "all"))
    ap.add_argument("--docs", default=None, help="with --corpus: comma-separated document ids")
    ap.add_argument("--genres", default=None, help="with --corpus: comma-separated genres")
    ap.add_argument("--max-doc-tokens", type=int, default=None, help="with --corpus: documents of at most this many "
                    "tokens (the manifest's count)")
    ap.add_argument("--per-kind", type=int, default=2, help="with --corpus: questions of each kind per document")
    ap.add_argument("--kinds", default=",".join(SINGLE_FACT), help="with --corpus: the question kinds (fact, copy)")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256, help="the bounded form's chunk (kvcli chat --chunk N)")
    ap.add_argument("--forms", default="bounded,exact")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("-o", "--out", default=None, help="JSON lines, one per answer, written as they come")
    ap.add_argument("--summarize", nargs="+", default=None, metavar="FILE.jsonl",
                    help="only print the counts of JSON lines this script wrote (runs of several documents together)")
    a = ap.parse_args()
    if a.summarize:
        summary(read_rows(a.summarize))
        return
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if not set(kinds) <= set(SINGLE_FACT):
        ap.error(f"--kinds: single-fact kinds only ({', '.join(SINGLE_FACT)})")
    docs = corpus_docs(a, kinds) if a.corpus else logbooks(a)
    session = NativeSession(resolve_model(a.model), n_ctx=0, n_threads=a.threads)
    sampler = Sampler(Sampling())   # the CLI's defaults (greedy + DRY)
    rows = []
    out = open(a.out, "w") if a.out else None
    for name, doc, items in docs:
        for form in a.forms.split(","):
            rows += one_form(a, session, sampler, form, name, doc, items, out)
    summary(rows)
    session.close()


def logbooks(a) -> list:
    """(name, Document, questions) of each seed's logbook: a question's `holds` tells whether a passage's text holds
    its planted sentence, `right` whether an answer holds the planted value as a whole number, `at` where the
    sentence starts."""
    out = []
    for seed in [int(x) for x in a.seeds.split(",")]:
        text, facts = make_document(a.words, a.facts, seed=seed)
        items = [{"question": f["question"], "answers": [f["answer"]], "kind": "planted",
                  "right": lambda ans, f=f: found(f["answer"], ans),
                  "holds": lambda passage, f=f: f["sentence"] in passage, "at": text.index(f["sentence"])}
                 for f in facts]
        out.append((f"logbook seed {seed}", Document(text, "text", "logbook"), items))
    return out


def corpus_docs(a, kinds: list) -> list:
    """(name, Document, questions) of the corpus's documents chosen by --split, --docs, --genres, --max-doc-tokens,
    each checked against the manifest's sha256, with their single-fact questions (questions.py draws them from the
    text's sha256, as `kvcli eval corpus questions` does): a passage holds the answer when it holds the blanked
    number or name (written once in the document)."""
    manifest = load_manifest(a.corpus)
    ids = [x.strip() for x in a.docs.split(",")] if a.docs else None
    genres = [x.strip() for x in a.genres.split(",")] if a.genres else None
    chosen = select(manifest, a.split, genres, ids, max_tokens=a.max_doc_tokens)
    if not chosen:
        raise SystemExit(f"no document of {a.corpus} matches --split/--docs/--genres/--max-doc-tokens")
    verify(a.corpus, chosen)
    out = []
    for d in chosen:
        text = (Path(a.corpus) / d["file"]).read_text(encoding="utf-8")
        items = []
        for q in make_questions(d["id"], text, d["format"], a.per_kind):
            if q.kind not in kinds:
                continue
            exact = q.kind == "copy"
            at = next((s for s, e in passages(text) if found(q.answers[0], text[s:e], exact)), None)
            items.append({"question": q.question, "answers": q.answers, "kind": q.kind,
                          "right": lambda ans, q=q: score_answer(q, ans) == 1,
                          "holds": lambda passage, q=q, exact=exact: found(q.answers[0], passage, exact), "at": at})
        out.append((d["id"], Document(text, "text", d["id"]), items))
    return out


def one_form(a, session, sampler, form: str, name: str, doc: Document, items: list, out) -> list:
    session.clear()
    conv = Conversation(session, doc.text, compression=resolve(session.model_path, a.policy, a.budget), reselect=True,
                        chunk=a.chunk if form == "bounded" else None)
    conv.source = doc
    conv.store_turns = False
    if conv.store_form(conv._cfg(None))[0] != form:   # a document whose full cache is past the exact form's
        print(f"[{form}, {name}] {len(conv.prefix_tokens)} tokens: not read in this form (kvcli chat reads it in "
              "the other)", file=sys.stderr, flush=True)
        conv.close()
        return []
    t0 = time.perf_counter()
    conv.read_store()
    read_s = time.perf_counter() - t0
    print(f"[{form}, {name}] {len(conv.prefix_tokens)} tokens read in {read_s:.1f}s"
          + (f", {len(conv.store.chunks)} chunks of {conv.store.chunk}" if conv.store.form == "bounded" else "")
          + f", {len(items)} questions", file=sys.stderr, flush=True)
    rows = []
    for f in items:
        if conv.turns:
            conv.reset()
        t1 = time.perf_counter()
        gen = conv.ask(f["question"], a.max_tokens, sampler)
        t2 = time.perf_counter()
        cited = cite_turn(conv, gen)
        cite_s = time.perf_counter() - t2
        hits = [f["holds"](doc.text[c.start:c.end]) for c in cited.passages]
        r = conv.last_reselection
        row = {"form": form, "doc": name, "kind": f["kind"], "question": f["question"], "answers": f["answers"],
               "answer": gen.text, "right": f["right"](gen.text), "first": bool(hits and hits[0]), "top3": any(hits),
               "ask_s": round(t2 - t1, 3), "cite_s": round(cite_s, 3), "note": cited.note,
               "tokens": len(conv.prefix_tokens), "cited": cited.as_json()}
        if conv.store.form == "bounded":
            row.update(streamed=r.streamed, stored=len(conv.store.chunks), read_s=round(read_s, 2),
                       fact_chunk=_chunk_of(conv, f["at"]) if f["at"] is not None else None)
            row["fact_streamed"] = row["fact_chunk"] in r.streamed
        rows.append(row)
        print(json.dumps({k: row.get(k) for k in ("form", "doc", "question", "answers", "answer", "right", "first",
                                                  "top3", "fact_streamed", "ask_s", "cite_s")})[:600],
              file=sys.stderr, flush=True)
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
        kinds = list(dict.fromkeys(r["kind"] for r in rs))
        for kind in ([None] + kinds if len(kinds) > 1 else [None]):
            ks = [r for r in rs if kind is None or r["kind"] == kind]
            print(("  " + kind if kind else form) + ": " + counts(ks))
        cs = sorted(r["cite_s"] for r in rs)
        print(f"  cite_s median {cs[len(cs) // 2]:.2f} ({cs[0]:.2f}-{cs[-1]:.2f}); ask_s median "
              f"{sorted(r['ask_s'] for r in rs)[len(rs) // 2]:.2f}")


def read_rows(paths: list) -> list:
    """The rows of JSON lines files this script wrote (a bad line names its file and line)."""
    rows = []
    for p in paths:
        try:
            lines = Path(p).read_text(encoding="utf-8").splitlines()
        except OSError as e:
            raise SystemExit(f"{p}: {e.strerror}") from None
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                raise SystemExit(f"{p}:{i}: not a JSON line") from None
            if row is not None and not {"form", "kind", "right", "first", "top3"} <= set(row):
                raise SystemExit(f"{p}:{i}: not a line of benchmarks/citations_forms.py")
            if row is not None:
                rows.append(row)
    if not rows:
        raise SystemExit("no answers in " + ", ".join(paths))
    return rows


def rate(k: int, n: int) -> str:
    """'k/n (p%, s.e. x%, 95% y-z%)': the standard error sqrt(p(1-p)/n) and the Wilson interval."""
    if n == 0:
        return "0/0"
    p, z = k / n, 1.96
    d = 1 + z * z / n
    mid, half = (p + z * z / (2 * n)) / d, z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return (f"{k}/{n} ({p:.0%}, s.e. {math.sqrt(p * (1 - p) / n):.0%}, 95% "
            f"{max(0.0, mid - half):.0%}-{min(1.0, mid + half):.0%})")


def counts(rs: list) -> str:
    right = [r for r in rs if r["right"]]
    line = (f"{len(right)}/{len(rs)} right; first cited passage holds the answer in "
            f"{rate(sum(r['first'] for r in right), len(right))} right answers ({sum(r['first'] for r in rs)}/"
            f"{len(rs)} of all), among the three cited in {sum(r['top3'] for r in right)}/{len(right)} "
            f"({sum(r['top3'] for r in rs)}/{len(rs)} of all)")
    if any("fact_streamed" in r for r in rs):
        line += f"; the answer's chunk streamed for {sum(r['fact_streamed'] for r in rs)}/{len(rs)}"
    return line


if __name__ == "__main__":
    main()
