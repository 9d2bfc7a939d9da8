"""How often the first cited passage holds the answer (docs/results/citations.md).

A logbook (kvcli/evaluation/logbook.py) with N planted facts, each question's answer one planted sentence (a line
of its own). Read once; every question answered in chat's exact re-selected form (kvcli chat's default) and, with
--run, also as `kvcli run` reads it (one prefill of document + question, compressed, answered). For each right
answer: is the planted sentence the first cited passage (and among the three cited)? Also reported: the same
ranking from other layer choices (all layers, the lower half, the last quarter), from the same observation.

    python benchmarks/citations.py --model qwen2.5-coder-0.5b --words 2400 --facts 12 --budget 256 --threads 1 \
        --seeds 0,1 -o citations.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from kvcli import citations
from kvcli.apps.chat import Conversation
from kvcli.apps.run_document import run_document
from kvcli.doc_formats import Document
from kvcli.evaluation.logbook import make_document
from kvcli.generate import Sampler, Sampling
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession
from kvcli.planning.planner import resolve

LAYERS = {"upper half": lambda n: citations.layer_weights(n), "all layers": lambda n: np.ones(n),
          "lower half": lambda n: 1.0 - citations.layer_weights(n),
          "last quarter": lambda n: (np.arange(n) >= 3 * n // 4).astype(float)}
# (tokens, layers): kvcli ranks by the tokens of words the question does not hold, over the upper half of the layers
VARIANTS = [(t, lay) for t in ("new words", "all tokens") for lay in LAYERS]


def judge(doc: Document, fact: dict, ranked: list) -> tuple[bool, bool]:
    hits = [fact["sentence"] in doc.text[c.start:c.end] for c in ranked]
    return bool(hits and hits[0]), any(hits)


def score_variants(doc, prompt_text, prompt_tokens, pieces, atts, fact) -> dict:
    out = {}
    for tokens, lay in VARIANTS:
        att = atts[tokens]
        ranked = citations.rank(doc, prompt_text, prompt_tokens, pieces, LAYERS[lay](att.shape[0]) @ att)
        out[f"{tokens}, {lay}"] = judge(doc, fact, ranked)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--words", type=int, default=2400)
    ap.add_argument("--facts", type=int, default=12)
    ap.add_argument("--seeds", default="0", help="logbooks, one per seed (comma-separated)")
    ap.add_argument("--policy", default="snapkv")
    ap.add_argument("--budget", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--run", action="store_true", help="also answer each question as kvcli run does (one prefill each)")
    ap.add_argument("--no-chat", action="store_true", help="only the --run form")
    ap.add_argument("-o", "--out", default=None, help="JSON lines, one per answer, written as they come")
    a = ap.parse_args()
    session = NativeSession(resolve_model(a.model), n_ctx=0, n_threads=a.threads)
    sampler = Sampler(Sampling())   # the CLI's defaults (greedy + DRY)
    rows = []
    out = open(a.out, "w") if a.out else None
    for seed in [int(x) for x in a.seeds.split(",")]:
        rows += one_logbook(a, session, sampler, seed, out)
    summary(rows)
    session.close()


def emit(rows: list, row: dict, out) -> None:
    rows.append(row)
    print(json.dumps({k: row[k] for k in ("form", "seed", "question", "answer", "right", "first", "top3", "cite_s")}),
          file=sys.stderr, flush=True)
    if out is not None:
        out.write(json.dumps(row) + "\n")
        out.flush()


def one_logbook(a, session, sampler, seed: int, out) -> list:
    text, facts = make_document(a.words, a.facts, seed=seed)
    doc = Document(text, "text", "logbook")
    rows = []
    session.clear()
    if not a.no_chat:
        rows += chat_form(a, session, sampler, seed, doc, text, facts, out)
    if a.run:
        rows += run_form(a, session, sampler, seed, doc, facts, out)
    return rows


def chat_form(a, session, sampler, seed, doc, text, facts, out) -> list:
    rows = []
    conv = Conversation(session, text, compression=resolve(session.model_path, a.policy, a.budget), reselect=True)
    conv.store_turns = False
    t0 = time.perf_counter()
    conv.read_store()
    print(f"{len(conv.prefix_tokens)} tokens read in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    pieces = citations.token_pieces(session, conv.prefix_tokens)
    for f in facts:
        if conv.turns:
            conv.reset()
        gen = conv.ask(f["question"], a.max_tokens, sampler)
        t1 = time.perf_counter()
        att, att_all = citations.answer_attention(session, conv.seq, gen.tokens,
                                                  citations.novelty_weights(session, gen.tokens, f["question"]))
        cite_s = time.perf_counter() - t1
        ranked = citations.rank(doc, conv.prefix_text(), conv.prefix_tokens, pieces,
                                citations.layer_weights(att.shape[0]) @ att)
        emit(rows, {"form": "chat exact", "seed": seed, "question": f["question"], "answer": gen.text,
                     "right": f["answer"] in gen.text,
                     "first": judge(doc, f, ranked)[0], "top3": judge(doc, f, ranked)[1], "cite_s": round(cite_s, 3),
                     "cited": [c.as_json() for c in ranked],
                     "variants": score_variants(doc, conv.prefix_text(), conv.prefix_tokens, pieces,
                                                {"new words": att, "all tokens": att_all}, f)}, out)
    conv.close()
    return rows


def run_form(a, session, sampler, seed, doc, facts, out) -> list:
    rows = []
    for f in facts:
        session.clear()
        r = run_document(session, doc, f["question"], compression=resolve(session.model_path, a.policy, a.budget),
                         max_tokens=a.max_tokens,
                         sampler=sampler, cite_answer=True)
        ranked = r.citations.passages
        emit(rows, {"form": "run", "seed": seed, "question": f["question"], "answer": r.answer,
                    "right": f["answer"] in r.answer, "first": judge(doc, f, ranked)[0],
                    "top3": judge(doc, f, ranked)[1], "cite_s": r.stats.get("cite_s"),
                    "cited": r.citations.as_json()}, out)
    return rows


def summary(rows: list) -> None:
    for form in dict.fromkeys(r["form"] for r in rows):
        rs = [r for r in rows if r["form"] == form]
        right = [r for r in rs if r["right"]]
        print(f"{form}: {len(right)}/{len(rs)} right; first cited passage holds the answer in "
              f"{sum(r['first'] for r in right)}/{len(right)} right answers ({sum(r['first'] for r in rs)}/{len(rs)} "
              f"of all), among the three cited in {sum(r['top3'] for r in right)}/{len(right)}")
        for name in (f"{t}, {lay}" for t, lay in VARIANTS):
            if all("variants" in r for r in rs):
                print(f"  {name}: first {sum(r['variants'][name][0] for r in right)}/{len(right)}, "
                      f"top 3 {sum(r['variants'][name][1] for r in right)}/{len(right)}")


if __name__ == "__main__":
    main()
