"""`kvcli eval corpus ask --mode reselect|bounded`: the corpus's questions answered as `kvcli chat` answers them
(issue #63).

kvcli/evaluation/corpus_eval.py asks the questions of caches compressed once, before any question. `kvcli chat`
does not answer that way by default: it keeps the document and re-selects its cache for every question. Here the
same questions (corpus_eval.doc_questions), scored the same way (corpus_eval.score_into), each asked alone as a
conversation's first question (the document and the question in one user turn, `render`), in one of two forms:

- `reselect` (chat's exact form, for a document whose full cache fits): the document's full cache read once and
  stored (kvcli/drivers/reselect.py StoredDocument, resident in the context where the model allows, as kvcli chat
  holds it), then for every question and configuration the prompt re-selected from it with the question known
  (restore or share, prefill the rest with observation, plan, gather: eval chat's `_reselections`, which lets
  configurations that observe alike share one observed prefill). `full` is the same prompt's full cache (nothing
  compacted): the reference each configuration's answers are compared with (corpus_eval.summarise's agreement).
- `bounded` (chat's bounded form, for documents past its exact limit or the model's context): per configuration
  the document read by bounded reading into a chunk store in the context kvcli chat gives that policy and budget
  (runner.read_store_as_chat), then every question re-selected from that one read in each of `forms`:
  `index`, the chunks the block index chooses (kvcli chat's default, runner.reselect_in_form); `all`, every stored
  chunk streamed, loaded together while they fit (the store's select 0: what KVCLI_RESELECT_CHUNKS=all makes
  kvcli chat do); `every_chunk`, every chunk through budget + one chunk with a probe each (eval chat's
  bounded_all). `all` is the reference of the other forms. Window policies only (bounded re-selection refuses
  column sums); `full` is not run. KVCLI_RESELECT_CHUNKS would override every form's choice: it is refused.

Answers are greedy (ANSWER_TOKENS, SUMMARY_TOKENS for the summary); `kv_bytes` is what the re-selected cache holds
before the answer is decoded.
"""
from __future__ import annotations

import os
import re
import time
from pathlib import Path

from kvcli.drivers.chunked import DEFAULT_CHUNK, pad_cells
from kvcli.drivers.reselect import StoredDocument
from kvcli.drivers.reselect_bounded import check_usable
from kvcli.engines import ContextFull, open_native
from kvcli.errors import KvcliError
from kvcli.evaluation.chat import QUESTION_SEQ, RESIDENT_SEQ, _reselections
from kvcli.evaluation.corpus_eval import (REFERENCE_FORM, answer_tokens, check_variants, corpus_result, doc_line,
                                          doc_questions, score_into)
from kvcli.evaluation.evidence import answer_spans, kept_share
from kvcli.evaluation.fidelity import MARGIN
from kvcli.evaluation.fidelity_reselect import _selection_cells
from kvcli.evaluation.measure import held, machine
from kvcli.evaluation.questions import KINDS
from kvcli.evaluation.runner import TRUNCATE, _greedy, _session, eval_configs, read_store_as_chat, reselect_in_form
from kvcli.evaluation.tasks import prefix_text, render

MODES = {"reselect": "re-selected per question from the stored full cache, as kvcli chat's exact form (each question "
                     "alone, the document and it in one user turn)",
         "bounded": "re-selected per question in kvcli chat's bounded form (the document read once per configuration "
                    "by bounded reading into a chunk store; each question alone, the document and it in one user "
                    "turn), in each of the forms"}
FORMS = ("index", "all", "every_chunk")
DEFAULT_FORMS = ("index", "all")


def run_corpus_chat(model_path, docs, policies: list[str], budgets: list[int], *, mode: str = "reselect",
                    forms=DEFAULT_FORMS, per_kind: int = 2, kinds=None, cache_type: str = "f16",
                    policy_args: dict | None = None, threads: int | None = None, doc_meta: dict | None = None,
                    formats: dict | None = None, log=None, stores=None) -> dict:
    """Every document x question x (policy, budget) [x form], re-selected (the module's docstring); the result as
    corpus_eval.run_corpus_questions gives it (records, summary, settings with the mode). `stores` (a folder, bounded
    mode): each configuration's read kept in it as <doc>-<policy>-<budget> and reused by the next run."""
    log = log or (lambda m: None)
    kinds = KINDS if kinds is None else kinds
    policy_args, doc_meta, formats = policy_args or {}, doc_meta or {}, formats or {}
    if mode not in MODES:
        raise KvcliError(f"--mode: unknown mode '{mode}' (choose from once, {', '.join(MODES)})")
    if TRUNCATE in policies:
        raise KvcliError("policy 'truncate' is for kvcli eval niah/ruler")
    forms = list(forms) if mode == "bounded" else []
    for f in forms:
        if f not in FORMS:
            raise KvcliError(f"--forms: unknown form '{f}' (choose from {', '.join(FORMS)})")
    if stores is not None and mode != "bounded":
        raise KvcliError("--stores is for --mode bounded (the reads it keeps are chunk stores)")
    if mode == "bounded" and not forms:
        raise KvcliError("--forms: name at least one form")
    if mode == "bounded" and os.environ.get("KVCLI_RESELECT_CHUNKS", "").strip():
        raise KvcliError("KVCLI_RESELECT_CHUNKS is set: it would choose every form's chunks; --mode bounded asks "
                         "each form itself (--forms): unset it")
    unavailable, resolved = check_variants(model_path, policies, budgets, policy_args)
    cfgs = eval_configs(policies, budgets)
    if mode == "bounded":   # no full cache to compare with there: recorded as not run only where asked for
        cfgs = [k for k in cfgs if k[0] != "full" or "full" in policies]
    run_keys = [k for k in cfgs if k[0] not in unavailable]
    tok = _session(model_path, 0, cache_type, threads)
    jobs = []   # (document, its questions, the stored prefix's tokens, each question's prompt)
    try:
        for d in docs:
            qs = doc_questions(d, formats, per_kind, kinds)
            jobs.append((d, qs, tok.tokenize(prefix_text(tok, d.text, False)),
                         [tok.tokenize(render(tok, d.text, [], q.question)) for q in qs]))
        n_ctx_train, n_layer, sliding = tok.n_ctx_train, tok.info.n_layer, bool(tok.info.sliding_layers)
    finally:
        tok.close()
    if mode == "reselect":   # every document's full cache must fit: said before the first read, not after hours
        for d, qs, _, prompts in jobs:
            for q, p in zip(qs, prompts):
                need = _cells(p, q, resolved, run_keys)
                if need > n_ctx_train:
                    raise KvcliError(f"{d.name}: its {q.kind} question needs {need} cells, more than the model's "
                                     f"context ({n_ctx_train}): re-selection holds the document's full cache "
                                     "(choose --max-doc-tokens, or --mode bounded)")
    records, t_start, where, interrupted, done = [], time.perf_counter(), machine(threads), False, 0
    session, session_ctx = None, 0
    resident = mode == "reselect" and not sliding
    try:
        if mode == "bounded":   # sized per configuration by read_store_as_chat, as kvcli chat sizes it
            session = open_native(model_path, n_ctx=pad_cells(DEFAULT_CHUNK), cache_type=cache_type,
                                  n_threads=threads, n_seq=2)
        for d, qs, head, prompts in jobs:
            done = len(records)
            if not qs:
                log(f"{d.name}: no question could be made")
                continue
            base = {"mode": mode, "doc": d.name, "doc_tokens": len(head), **doc_meta.get(d.name, {})}
            if mode == "bounded":
                records += _bounded_document(session, base, d.text, qs, head, prompts, cfgs, resolved, unavailable,
                                             forms, stores)
            else:
                need = pad_cells(max(_cells(p, q, resolved, run_keys) + (
                    _selection_cells_of(resolved, run_keys, n_layer, len(p)) if resident else 0)
                    for q, p in zip(qs, prompts)))
                if session is None or session_ctx < need or session_ctx > 2 * need:
                    if session is not None:
                        session.close()
                    session = open_native(model_path, n_ctx=need, cache_type=cache_type, flash_attn=True,
                                          n_threads=threads, n_seq=RESIDENT_SEQ + 1 if resident else 1)
                    session_ctx = need
                records += _reselect_document(session, base, d.text, qs, head, prompts, cfgs, run_keys, resolved,
                                              unavailable, resident)
            log(doc_line(d.name, len(qs), records[done:]))
    except KeyboardInterrupt:   # the documents asked whole are the result
        interrupted = True
        del records[done:]
    finally:
        if session is not None:
            session.close()
    return corpus_result(model_path, where, interrupted, t_start, records,
                         {"policies": policies, "budgets": budgets, "per_kind": per_kind, "kinds": list(kinds),
                          "cache_type": cache_type, "docs": [d.name for d in docs], "policy_args": policy_args,
                          "mode": mode, "layout": MODES[mode], **({"forms": forms} if forms else {})})


def _cells(prompt, q, resolved, run_keys) -> int:
    """Positions a re-selected prompt and its answer take: the prompt, the answer, a margin and what a policy needs
    after the prompt (its observation window, a second pass's room), as eval fidelity --form reselect sizes them."""
    return len(prompt) + answer_tokens(q) + MARGIN + max(
        [resolved[k].observe[1] + resolved[k].spec.room_after(len(prompt), resolved[k].params) for k in run_keys],
        default=0)


def _selection_cells_of(resolved, run_keys, n_layer: int, n: int) -> int:
    """Cells the widest configuration's selection is gathered into beside the resident document."""
    return max([_selection_cells(resolved[k], n_layer, n) for k in run_keys], default=0)


def _record(base: dict, i: int, q, prompt, pol, bud, status: str, **extra) -> dict:
    return {**base, "question": i, "kind": q.kind, "policy": pol, "budget": bud, **extra, "status": status,
            "score": None, "answers": q.answers, "depth": q.depth, "prompt_tokens": len(prompt)}


def _reselect_document(session, base, text, qs, head, prompts, cfgs, run_keys, resolved, unavailable,
                       resident) -> list[dict]:
    """One document in the exact form: its full cache read once and stored (resident where the model allows), then
    every question re-selected for every configuration (`_reselections`), the full cache's answers first."""
    session.clear()
    colsum = any("colsum" in resolved[k].observe[0] for k in run_keys)
    store = StoredDocument.read(session, head, colsum=colsum,
                                **({"seq": RESIDENT_SEQ, "resident": True} if resident else {}))
    base = {**base, "store_read_s": round(store.read_s, 3), "store_bytes": store.nbytes}
    recs = []
    try:
        for i, (q, prompt) in enumerate(zip(qs, prompts)):
            answers = {}
            for key, stats in _reselections(session, store, {k: prompt for k in run_keys},
                                            {k: resolved[k] for k in run_keys}):
                kept = held(session)   # the re-selected cache, before the answer's tokens
                t0 = time.perf_counter()
                pred = _greedy(session, session.logits(0), answer_tokens(q))
                answers[key] = pred, {**stats, **kept, "answer_s": round(time.perf_counter() - t0, 4)}
                session.clear(0)
            ref = answers.get(("full", None), (None,))[0]
            for pol, bud in cfgs:
                if pol in unavailable:
                    recs.append(_record(base, i, q, prompt, pol, bud, unavailable[pol]))
                    continue
                pred, stats = answers[(pol, bud)]
                rec = _record(base, i, q, prompt, pol, bud, "ok", **stats)
                score_into(rec, q, pred, text, ref)
                recs.append(rec)
    finally:
        if session.n_seq > QUESTION_SEQ:
            session.clear(QUESTION_SEQ)
        store.close()
    return recs


def _reselect_form(cs, session, prompt, cfg, step: int, form: str):
    """`prompt` re-selected from the chunk store `cs` in `form` (the module's docstring)."""
    if form == "all":   # every chunk, loaded together while they fit: kvcli chat with KVCLI_RESELECT_CHUNKS=all
        cs.select = 0
        return cs.reselect(session, prompt, cfg)
    return reselect_in_form(cs, session, prompt, cfg, step, form == "every_chunk")


def _bounded_document(session, base, text, qs, head, prompts, cfgs, resolved, unavailable, forms,
                      stores=None) -> list[dict]:
    """One document in the bounded form: per configuration one read into a chunk store (or the one kept in
    `stores` by an earlier run), then every question in every form from it (the reference form first: the others'
    summaries are scored against its). The context is put back as it was after."""
    n_ctx0, asked, recs = session.n_ctx, session.cache_type, []
    order = sorted(forms, key=lambda f: f != REFERENCE_FORM)
    try:
        for pol, bud in cfgs:
            why = unavailable.get(pol) or ("not run: the bounded form re-selects a compressing policy's budget"
                                           if pol == "full" else None)
            if why is None:
                try:
                    check_usable(session, resolved[(pol, bud)], 1)
                except KvcliError as e:
                    why = f"not run: {e}"
            if why is not None:
                recs += [_record(base, i, q, p, pol, bud, why, form=f) for i, (q, p) in enumerate(zip(qs, prompts))
                         for f in forms]
                continue
            cfg = resolved[(pol, bud)]
            kept = None if stores is None else Path(stores) / re.sub(r"[^\w.-]", "_", f"{base['doc']}-{pol}-{bud}")
            cs, step = read_store_as_chat(session, head, cfg, default_chunk=DEFAULT_CHUNK, cache_type=asked, kept=kept)
            read = {"read_s": round(cs.read_s, 3), "read_resumed_tokens": cs.resumed_tokens,
                    "store_bytes": cs.nbytes, "chunk": step, "chunk_type": cs.chunk_type, "n_ctx": session.n_ctx}
            try:
                for i, (q, prompt) in enumerate(zip(qs, prompts)):
                    answers, spans = {}, answer_spans(session, q, text, prompt)
                    for form in order:
                        try:
                            r = _reselect_form(cs, session, prompt, cfg, step, form)
                        except (KvcliError, ContextFull) as e:
                            session.clear(0)
                            answers[form] = None, {"status": f"error: {e}"}
                            continue
                        stats = {"reselect_s": round(r.total_s, 4), "reselect_chunks": r.chunks,
                                 "stored_chunks": r.stored, "index_s": round(r.index_s, 4),
                                 "streamed": r.streamed, "chunks_per_question": cs.chunks_per_question(bud),
                                 "answer_kept": None if spans is None else kept_share(
                                     r.origins.slot_origins(session, 0), spans),
                                 **held(session)}
                        t0 = time.perf_counter()
                        pred = _greedy(session, session.logits(0), answer_tokens(q))
                        answers[form] = pred, {**stats, "answer_s": round(time.perf_counter() - t0, 4)}
                        session.clear(0)
                    ref = answers.get(REFERENCE_FORM, (None,))[0]
                    for form in forms:
                        pred, stats = answers[form]
                        rec = _record(base, i, q, prompt, pol, bud, stats.pop("status", "ok"), form=form, **read,
                                      **stats)
                        if pred is not None:
                            score_into(rec, q, pred, text, ref)
                        recs.append(rec)
            finally:
                cs.select = None
                cs.close()
    finally:
        session.clear()
        session.use_cache_type(asked)   # a q8_0 store was read in float16
        if session.n_ctx != n_ctx0:
            session.resize_context(n_ctx0)
    return recs

