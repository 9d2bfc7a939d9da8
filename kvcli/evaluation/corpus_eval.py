"""`kvcli eval corpus ask`: the questions of kvcli/evaluation/questions.py asked of compressed caches (issue #63).

Compress-once, question-agnostic (as `kvcli compress` / `kvcli chat --compress-once` and eval chat's `alone` mode):
per document, the agnostic prefix (the chat template's head, the document and kvcli's generic instruction,
kvcli.templating.GENERIC_SUFFIX) is prefilled once and compressed by every (policy, budget)
(`runner.compressed_variants`: one shared prefill, kvzip's reconstruction pass once); after each configuration's
cache every question is asked alone as the next user turn and answered greedily, then its turn is removed again.
The full cache of the same prefix comes first, so each configuration's score is also given against the full cache's
on the same questions, and the summary question is scored against the full cache's summary (`summary_scores`).

Scores per question: fact, copy, combine and structure by `score_answer` (0-100, the share of the answers found);
summary by `supported` (100 x the share of the summary's numbers and names that the document contains) with its
`unsupported` list and `agreement_f1` against the full cache. Not yet run here beyond the tests: see
docs/results/real-text.md.
"""
from __future__ import annotations

import math
import time

import numpy as np

from kvcli.errors import KvcliError
from kvcli.evaluation.measure import machine
from kvcli.evaluation.questions import KINDS, make_questions, score_answer, summary_scores
from kvcli.drivers.bench import availability
from kvcli.drivers.compress import resolve
from kvcli.evaluation.runner import TRUNCATE, _greedy, _session, compressed_variants, eval_configs
from kvcli.evaluation.tasks import prefix_text, render

ANSWER_TOKENS = 32
SUMMARY_TOKENS = 160


def run_corpus_questions(model_path, docs, policies: list[str], budgets: list[int], *, per_kind: int = 2,
                         kinds=KINDS, cache_type: str = "f16", policy_args: dict | None = None,
                         threads: int | None = None, doc_meta: dict | None = None, formats: dict | None = None,
                         log=None) -> dict:
    """Every document x (policy, budget) x question (the module's docstring). `docs`: .name and .text;
    `formats`: name -> the manifest's format (default "underline"); `doc_meta`: fields copied into the records."""
    log = log or (lambda m: None)
    policy_args, doc_meta, formats = policy_args or {}, doc_meta or {}, formats or {}
    if TRUNCATE in policies:
        raise KvcliError("policy 'truncate' is for kvcli eval niah/ruler")
    unavailable, resolved = check_variants(model_path, policies, budgets, policy_args)
    cfgs = eval_configs(policies, budgets)
    tok = _session(model_path, 0, cache_type, threads)
    records, t_start, where, interrupted = [], time.perf_counter(), machine(threads), False
    session, done = None, 0
    try:
        for d in docs:
            qs = [q for q in make_questions(d.name, d.text, formats.get(d.name, "underline"), per_kind)
                  if q.kind in kinds]
            prefix = prefix_text(tok, d.text, agnostic=True)
            toks = tok.tokenize(prefix)
            turns = []
            for q in qs:
                full = render(tok, d.text, [], q.question, agnostic=True)
                if not full.startswith(prefix):
                    raise KvcliError("the chat template does not extend the agnostic prefix")
                turns.append(tok.tokenize(full[len(prefix):]))
            need = len(toks) + max((len(t) for t in turns), default=0) + SUMMARY_TOKENS + 16
            if need > tok.n_ctx_train:
                raise KvcliError(f"{d.name}: {need} cells exceed the model's context ({tok.n_ctx_train})")
            if session is not None:
                session.close()
            session = _session(model_path, need, cache_type, threads)
            done, full_summary = len(records), None
            base = {"doc": d.name, "doc_tokens": len(toks), **doc_meta.get(d.name, {})}
            for pol, bud, status, _first, _note, stats in compressed_variants(session, toks, cfgs, resolved,
                                                                              unavailable):
                mark = session.seq(0).next_pos
                for q, turn in zip(qs, turns):
                    rec = {**base, "kind": q.kind, "policy": pol, "budget": bud, "status": status, "score": None,
                           "answers": q.answers, "depth": q.depth, **{k: stats[k] for k in ("kv_bytes",) if k in stats}}
                    if status == "ok":
                        session.truncate(0, mark)
                        session.prefill(turn, seq=0)
                        summary = q.kind == "summary"
                        pred = _greedy(session, session.logits(0), SUMMARY_TOKENS if summary else ANSWER_TOKENS)
                        rec["prediction"] = pred.strip()
                        if summary:
                            if pol == "full":
                                full_summary = pred
                            s = summary_scores(pred, d.text, full_summary)
                            rec.update(score=100 * s["supported"], unsupported=s["unsupported"],
                                       agreement_f1=s.get("agreement_f1"))
                        else:
                            rec["score"] = 100 * score_answer(q, pred)
                    records.append(rec)
                session.clear(0)
            log(f"{d.name}: {len(qs)} questions; " + ", ".join(
                f"{p}{'' if b is None else '@' + str(b)} "
                f"{_mean([r['score'] for r in records[done:] if (r['policy'], r['budget']) == (p, b)])}"
                for p, b in cfgs))
    except KeyboardInterrupt:   # the documents asked whole are the result
        interrupted = True
        del records[done:]
    finally:
        if session is not None:
            session.close()
        tok.close()
    return {"kind": "eval", "task": "corpus-questions", "model": str(model_path), "machine": where,
            "interrupted": interrupted,
            "settings": {"policies": policies, "budgets": budgets, "per_kind": per_kind, "kinds": list(kinds),
                         "cache_type": cache_type, "docs": [d.name for d in docs], "policy_args": policy_args,
                         "mode": "compress once (question-agnostic), each question alone after the cache"},
            "elapsed_s": time.perf_counter() - t_start, "records": records, "summary": summarise(records)}


def split_variant(label: str) -> tuple[str, dict]:
    """'kvzip:alloc=global' -> ('kvzip', {'alloc': 'global'}): one policy run with two settings side by side in
    one eval, sharing its prefill and kvzip's reconstruction pass (`compressed_variants` keys by label)."""
    name, _, rest = label.partition(":")
    args = {}
    for item in rest.split(":") if rest else ():
        k, eq, v = item.partition("=")
        if not eq or not k.strip() or k.strip() in args:
            raise KvcliError(f"--policies: '{label}' expects POLICY or POLICY:KEY=VALUE[:KEY=VALUE] with each key once")
        args[k.strip()] = v.strip()
    if not name or (args and name == "full"):
        raise KvcliError(f"--policies: '{label}' expects POLICY or POLICY:KEY=VALUE[:KEY=VALUE] (full takes none)")
    return name, args


def check_variants(model_path, labels: list[str], budgets: list[int], policy_args: dict) -> tuple[dict, dict]:
    """As runner._check_policies, for labels that may carry their own arguments (`split_variant`): those override
    the --policy-arg POLICY.KEY=VALUE of their policy. Returns (unavailable, resolved), keyed by label."""
    why, resolved = {}, {}
    for label, b in eval_configs(labels, budgets):
        if label == TRUNCATE or label in why:
            continue
        name, args = split_variant(label)
        w = availability(name)
        if w:
            why[label] = w
        else:
            resolved[(label, b)] = resolve(model_path, name, b, {**policy_args.get(name, {}), **args})
    return why, resolved


def _mean(xs) -> str:
    xs = [x for x in xs if x is not None]
    return f"{np.mean(xs):.0f}" if xs else "-"


def summarise(records: list[dict]) -> list[dict]:
    """Per (policy, budget, kind) and over every kind but summary: mean score +- standard error over questions, and
    the full cache's mean on the same questions."""
    out = []
    keys = list(dict.fromkeys((r["policy"], r["budget"]) for r in records))
    full = {(r["doc"], r["kind"], tuple(r["answers"]), r["depth"]): r["score"] for r in records
            if r["policy"] == "full"}
    for pol, bud in keys:
        for kind in [*KINDS, "questions"]:
            rs = [r for r in records if (r["policy"], r["budget"]) == (pol, bud)
                  and (r["kind"] == kind or (kind == "questions" and r["kind"] != "summary"))]
            if not rs:
                continue
            item = {"policy": pol, "budget": bud, "kind": kind, "n": len(rs)}
            if any(r["score"] is None for r in rs):
                item.update(score=None, status=next(r["status"] for r in rs if r["score"] is None))
            else:
                xs = [r["score"] for r in rs]
                item.update(score=float(np.mean(xs)),
                            se=float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None)
                ref = [full.get((r["doc"], r["kind"], tuple(r["answers"]), r["depth"])) for r in rs]
                if all(v is not None for v in ref):
                    item["full_score"] = float(np.mean(ref))
                if kind == "summary":
                    f1 = [r["agreement_f1"] for r in rs if r.get("agreement_f1") is not None]
                    item["agreement_f1"] = float(np.mean(f1)) if f1 else None
                    item["unsupported"] = sum(len(r.get("unsupported") or ()) for r in rs)
            out.append(item)
    return out


def questions_table(result: dict) -> str:
    rows = result["summary"]
    kinds = [k for k in [*KINDS, "questions"] if any(r["kind"] == k for r in rows)]
    head = f"{'policy':<20}" + "".join(f"{k:>18}" for k in kinds)
    lines = ["corpus questions: % right +- s.e. (summary: % of its numbers and names the document holds); "
             "compressed once, each question alone", head, "-" * len(head)]
    for pol, bud in dict.fromkeys((r["policy"], r["budget"]) for r in rows):
        cells = []
        for k in kinds:
            m = [r for r in rows if (r["policy"], r["budget"], r["kind"]) == (pol, bud, k)]
            if not m:
                cells.append("")
            elif m[0]["score"] is None:
                cells.append(str(m[0].get("status"))[:17])
            else:
                se = m[0].get("se")
                cells.append(f"{m[0]['score']:.0f}" + ("" if se is None else f" +- {se:.0f}") + f" ({m[0]['n']})")
        lines.append(f"{pol if bud is None else f'{pol}@{bud}':<20}" + "".join(f"{c:>18}" for c in cells))
    return "\n".join(lines)
