"""`kvcli eval corpus ask`: the questions of kvcli/evaluation/questions.py asked of compressed caches (issue #63).

Compress-once, question-agnostic (as `kvcli compress` / `kvcli chat --compress-once` and eval chat's `alone` mode):
per document, the agnostic prefix (the chat template's head, the document and kvcli's generic instruction,
kvcli.templating.GENERIC_SUFFIX) is prefilled once and compressed by every (policy, budget)
(`runner.compressed_variants`: one shared prefill, kvzip's reconstruction pass once); after each configuration's
cache every question is asked alone as the next user turn and answered greedily, then its turn is removed again.
The full cache of the same prefix comes first, so each configuration's score is also given against the full cache's
on the same questions, and the summary question is scored against the full cache's summary (`summary_scores`).
The same questions asked as `kvcli chat` answers them (re-selected per question, exact or bounded form):
kvcli/evaluation/corpus_reselect.py; records carry their `mode` ("once" here) and summarise/questions_table show it.

Scores per question: fact, copy, combine and structure by `score_answer` (0-100, the share of the answers found);
summary by `supported` (100 x the share of the summary's numbers and names that the document contains) with its
`unsupported` list and `agreement_f1` against the full cache. Agreement (`summarise`): of the questions but the
summary that a configuration's reference (the full cache; in the bounded form, every chunk streamed) gets right
(every answer found), the share the configuration also gets right, with its binomial standard error.
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
LAYOUT = "compress once (question-agnostic), each question alone after the cache"


def doc_questions(d, formats: dict, per_kind: int, kinds) -> list:
    """The document's questions of `kinds` (`formats`: name -> the manifest's format, default "underline")."""
    return [q for q in make_questions(d.name, d.text, formats.get(d.name, "underline"), per_kind) if q.kind in kinds]


def answer_tokens(q) -> int:
    return SUMMARY_TOKENS if q.kind == "summary" else ANSWER_TOKENS


def score_into(rec: dict, q, pred: str, text: str, ref_summary: str | None) -> None:
    """Put the prediction and its score in `rec`: fact, copy, combine and structure by `score_answer`; the summary
    by `summary_scores`, with its unigram F1 against `ref_summary` (the reference's summary; None: none)."""
    rec["prediction"] = pred.strip()
    if q.kind == "summary":
        s = summary_scores(pred, text, ref_summary)
        rec.update(score=100 * s["supported"], unsupported=s["unsupported"], agreement_f1=s.get("agreement_f1"))
    else:
        rec["score"] = 100 * score_answer(q, pred)


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
            qs = doc_questions(d, formats, per_kind, kinds)
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
            base = {"mode": "once", "doc": d.name, "doc_tokens": len(toks), **doc_meta.get(d.name, {})}
            for pol, bud, status, _first, _note, stats in compressed_variants(session, toks, cfgs, resolved,
                                                                              unavailable):
                mark = session.seq(0).next_pos
                for i, (q, turn) in enumerate(zip(qs, turns)):
                    rec = {**base, "question": i, "kind": q.kind, "policy": pol, "budget": bud, "status": status,
                           "score": None, "answers": q.answers, "depth": q.depth,
                           **{k: stats[k] for k in ("kv_bytes",) if k in stats}}
                    if status == "ok":
                        session.truncate(0, mark)
                        session.prefill(turn, seq=0)
                        pred = _greedy(session, session.logits(0), answer_tokens(q))
                        if q.kind == "summary" and pol == "full":
                            full_summary = pred
                        score_into(rec, q, pred, d.text, full_summary)
                    records.append(rec)
                session.clear(0)
            log(doc_line(d.name, len(qs), records[done:]))
    except KeyboardInterrupt:   # the documents asked whole are the result
        interrupted = True
        del records[done:]
    finally:
        if session is not None:
            session.close()
        tok.close()
    return corpus_result(model_path, where, interrupted, t_start, records,
                         {"policies": policies, "budgets": budgets, "per_kind": per_kind, "kinds": list(kinds),
                          "cache_type": cache_type, "docs": [d.name for d in docs], "policy_args": policy_args,
                          "mode": "once", "layout": LAYOUT})


def corpus_result(model_path, where: dict, interrupted: bool, t_start: float, records: list[dict],
                  settings: dict) -> dict:
    """What `kvcli eval corpus ask` writes, in every mode: the records, their summary and the run's settings."""
    return {"kind": "eval", "task": "corpus-questions", "model": str(model_path), "machine": where,
            "interrupted": interrupted, "settings": settings, "elapsed_s": time.perf_counter() - t_start,
            "records": records, "summary": summarise(records)}


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


def config_key(r: dict) -> tuple:
    """A record's configuration: (mode, policy, budget, form); form None but in the bounded mode."""
    return r.get("mode", "once"), r["policy"], r["budget"], r.get("form")


def config_label(key: tuple) -> str:
    _, pol, bud, form = key
    return f"{pol}{'' if bud is None else f'@{bud}'}{'' if form is None else f' {form}'}"


def reference_key(key: tuple) -> tuple:
    """The configuration a record's answers are compared with: the full cache of the same mode (compress-once,
    re-selected), or, in the bounded form, the same policy and budget with every chunk streamed (REFERENCE_FORM)."""
    mode, pol, bud, form = key
    return (mode, pol, bud, REFERENCE_FORM) if mode == "bounded" else (mode, "full", None, None)


REFERENCE_FORM = "all"   # the bounded form's reference: every stored chunk streamed (KVCLI_RESELECT_CHUNKS=all)
RIGHT = 100.0            # a question counts as right when every one of its answers is found


def doc_line(name: str, n_questions: int, records: list[dict]) -> str:
    """A document's progress line: each configuration's mean score on its questions."""
    keys = list(dict.fromkeys(config_key(r) for r in records))
    return f"{name}: {n_questions} questions; " + ", ".join(
        f"{config_label(k)} {_mean([r['score'] for r in records if config_key(r) == k])}" for k in keys)


def agreement(pairs: list[tuple[float, float]]) -> dict:
    """Of (score, reference score) pairs, those the reference gets right: how many (agree_n), the share the
    configuration also gets right (agree, 0..1) and its binomial standard error (agree_se; None below two)."""
    ref_right = [s for s, ref in pairs if ref >= RIGHT]
    if not ref_right:
        return {"agree_n": 0, "agree": None, "agree_se": None}
    p = sum(s >= RIGHT for s in ref_right) / len(ref_right)
    n = len(ref_right)
    return {"agree_n": n, "agree": p, "agree_se": math.sqrt(p * (1 - p) / n) if n > 1 else None}


def summarise(records: list[dict]) -> list[dict]:
    """Per configuration (mode, policy, budget, form) and kind, and over every kind but summary ("questions"): mean
    score +- standard error over questions; the reference's mean on the same questions (`ref_score`, and
    `full_score` where the reference is the full cache) and the agreement with it (`agreement`)."""
    out = []
    keys = list(dict.fromkeys(config_key(r) for r in records))
    by_q = {(config_key(r), r["doc"], r.get("question", (r["kind"], tuple(r["answers"]), r["depth"]))): r["score"]
            for r in records}
    for key in keys:
        ref_key = reference_key(key)
        for kind in [*KINDS, "questions"]:
            rs = [r for r in records if config_key(r) == key
                  and (r["kind"] == kind or (kind == "questions" and r["kind"] != "summary"))]
            if not rs:
                continue
            item = {"mode": key[0], "policy": key[1], "budget": key[2], "form": key[3], "kind": kind, "n": len(rs)}
            if any(r["score"] is None for r in rs):
                item.update(score=None, status=next(r["status"] for r in rs if r["score"] is None))
                out.append(item)
                continue
            xs = [r["score"] for r in rs]
            item.update(score=float(np.mean(xs)),
                        se=float(np.std(xs, ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else None)
            ref = [by_q.get((ref_key, r["doc"], r.get("question", (r["kind"], tuple(r["answers"]), r["depth"]))))
                   for r in rs]
            if ref and all(v is not None for v in ref):
                item.update(reference=config_label(ref_key), ref_score=float(np.mean(ref)))
                if ref_key[1] == "full":
                    item["full_score"] = item["ref_score"]
                if kind != "summary" and ref_key != key:
                    item.update(agreement(list(zip(xs, ref))))
            kept = [r["answer_kept"] for r in rs if r.get("answer_kept") is not None]
            if kept:   # the bounded form: the share of heads holding the answer's tokens (evaluation/evidence.py)
                item.update(answer_kept=float(np.mean(kept)), answer_kept_n=len(kept),
                            answer_kept_se=float(np.std(kept, ddof=1) / math.sqrt(len(kept))) if len(kept) > 1
                            else None)
            if kind == "summary":
                f1 = [r["agreement_f1"] for r in rs if r.get("agreement_f1") is not None]
                item["agreement_f1"] = float(np.mean(f1)) if f1 else None
                item["unsupported"] = sum(len(r.get("unsupported") or ()) for r in rs)
            out.append(item)
    return out


TITLES = {"once": "compressed once, each question alone",
          "reselect": "re-selected per question from the stored full cache (kvcli chat's exact form)",
          "bounded": "re-selected per question in the bounded form (index: the block index's chunks; all: every "
                     "chunk streamed)"}


def questions_table(result: dict) -> str:
    rows = result["summary"]
    kinds = [k for k in [*KINDS, "questions"] if any(r["kind"] == k for r in rows)]
    keys = list(dict.fromkeys(config_key(r) for r in rows))
    modes = list(dict.fromkeys(k[0] for k in keys))
    width = max([len(config_label(k)) + (len(k[0]) + 1 if len(modes) > 1 else 0) for k in keys] + [18]) + 2
    head = f"{'configuration':<{width}}" + "".join(f"{k:>18}" for k in kinds) + f"{'agrees with ref.':>22}"
    lines = ["corpus questions: % right +- s.e. (n) (summary: % of its numbers and names the document holds); "
             + "; ".join(TITLES.get(m, m) for m in modes),
             "agrees: of the questions (not the summary) the reference gets right (the full cache; bounded: all), "
             "the % this one gets right too +- s.e. (of n)", head, "-" * len(head)]
    why: dict = {}   # the configurations not run or failed, and why (once each, after the table)
    for key in keys:
        cells = []
        for k in kinds:
            m = [r for r in rows if config_key(r) == key and r["kind"] == k]
            if not m:
                cells.append("")
            elif m[0]["score"] is None:
                status = str(m[0].get("status"))
                head = status.partition(":")[0] if status.startswith(("not run:", "error:")) else status
                cells.append(head[:17])
                if head != status:
                    why.setdefault(config_label(key), status)
            else:
                se = m[0].get("se")
                cells.append(f"{m[0]['score']:.0f}" + ("" if se is None else f" +- {se:.0f}") + f" ({m[0]['n']})")
        q = next((r for r in rows if config_key(r) == key and r["kind"] == "questions"), {})
        agree = "" if q.get("agree") is None else (
            f"{100 * q['agree']:.0f}" + ("" if q["agree_se"] is None else f" +- {100 * q['agree_se']:.0f}")
            + f" (of {q['agree_n']})")
        label = (f"{key[0]} " if len(modes) > 1 else "") + config_label(key)
        lines.append(f"{label:<{width}}" + "".join(f"{c:>18}" for c in cells) + f"{agree:>22}")
    kept = [(config_label(config_key(r)), r) for r in rows if r["kind"] == "questions" and "answer_kept" in r]
    if kept:
        lines.append("answer kept (the share of the answer's tokens, where the document writes them, that a layer x "
                     "KV-head cache holds; mean +- s.e. over questions): "
                     + "; ".join(f"{label} {100 * r['answer_kept']:.0f}"
                                 + ("" if r["answer_kept_se"] is None else f" +- {100 * r['answer_kept_se']:.0f}")
                                 + f"% ({r['answer_kept_n']})" for label, r in kept))
    return "\n".join(lines + [f"{label}: {status}" for label, status in why.items()])
