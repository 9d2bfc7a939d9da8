"""`kvcli eval fidelity --form reselect`: the question-free fidelity of re-selection per question (issue #63).

Compress-once fidelity (kvcli/evaluation/fidelity.py) scores a cache compressed before anything follows it on the
document's own next tokens. A cache re-selected per question is compressed for the question it answers, so the
scored tokens must come after a question, and the selection must not see them. Here, for each document D and each
probe Q (a question made from D without a question bank):

    the prompt [chat template head, D, Q in one user turn, assistant turn] is re-selected for Q exactly as
    `kvcli chat` re-selects its exact form (D's full cache read once and stored, resident in the context; each
    probe restored or shared from it, its rest prefilled with observation, planned and gathered:
    kvcli/evaluation/chat.py `_reselections`, StoredDocument.reselect), then a continuation is fed teacher-forced
    one token a decode step and every next-token distribution is read.

The reference is the full cache of the same prompt (D's stored cache and Q prefilled after it, no compaction), fed
the same tokens. Per position: KL(full || re-selected) in nats, top-1 agreement and the log-probability of the
continuation's token, pooled as compress-once pools them (fidelity.summarise).

Probes (`probes`):
- `quote` at each depth d of `depths`: from the first line that starts at or after d x the document's characters,
  its next LEAD_WORDS words (the lead-in, moved a line on until it occurs once in D) are quoted in QUOTE_QUESTION;
  the continuation is the document's own text after the lead-in (its first `cont` tokens). The answer is in D, the
  question points at where; the selection sees the lead-in, never the continuation.
- `summary`: questions.SUMMARY_QUESTION (the corpus's generic question); the continuation is the full cache's own
  greedy answer (its first `cont` tokens, up to and including an end of generation), so the full cache's top-1 is
  its own answer and the others are scored on whether they would continue it.

Each probe is a conversation's first question (no earlier turns, nothing kept for a next one: `extend` off).
`lengths` None (`--lengths all`): the whole document; a length L: the text of its first L tokens.

`form` "aware" (`--form aware`) scores the same probes compressed once for the question instead: each probe's whole
prompt prefilled and compressed by every configuration (question-aware, as `kvcli run --question` and `kvcli chat
--compress-once QUESTION` compress it; one prefill shared as `kvcli eval fidelity --form once` shares a prefix:
runner.compressed_variants), then the same continuation scored the same way against the full cache of that prefill.
Nothing is stored: what re-selection from a stored document costs or gains against compressing once for the question.
"""
from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass

import numpy as np

from kvcli.drivers.chunked import pad_cells
from kvcli.drivers.reselect import StoredDocument
from kvcli.engines import open_native
from kvcli.errors import KvcliError
from kvcli.evaluation.chat import QUESTION_SEQ, RESIDENT_SEQ, _reselections
from kvcli.evaluation.corpus_eval import check_variants
from kvcli.evaluation.fidelity import MARGIN, _continuation, compare, summarise
from kvcli.evaluation.measure import held, log_softmax, machine
from kvcli.evaluation.questions import SUMMARY_QUESTION
from kvcli.evaluation.runner import TRUNCATE, _session, compressed_variants, eval_configs
from kvcli.evaluation.tasks import prefix_text, render

PROBES = ("quote", "summary")
DEFAULT_DEPTHS = (0.25, 0.5, 0.75)
LEAD_WORDS = 24
QUOTE_QUESTION = "Continue this passage of the document word for word, from where it stops:\n\n{lead}"
SELECTION_ROOM = 128   # cells beside the budget for a question's gathered selection (eval chat's)
LAYOUT = ("re-selected per question as kvcli chat's exact form (the document's full cache stored and resident, each "
          "probe prefilled after it with observation, planned and gathered), the probe's continuation "
          "teacher-forced one token a step")
AWARE_LAYOUT = ("compressed once for each probe, question-aware (the probe's whole prompt prefilled and compressed, "
                "one prefill shared by every configuration, as kvcli run --question compresses it), the probe's "
                "continuation teacher-forced one token a step")
FORMS = {"reselect": LAYOUT, "aware": AWARE_LAYOUT}
_WORD = re.compile(r"\S+")


@dataclass
class Probe:
    label: str               # "quote@0.5", "summary"
    kind: str
    depth: float | None
    question: str
    target: list[int] | None   # None: the full cache's greedy answer
    offset: int | None = None  # the lead-in's first character in the document (quote)


def quote_lead(text: str, depth: float, words: int = LEAD_WORDS) -> tuple[str, int, int] | None:
    """(lead-in, its start, its end) in `text`: the first `words` words of the first line starting at or after
    depth x len(text) whose lead-in occurs once in the text; None when no line after there has one."""
    start = int(depth * len(text))
    if start > 0 and text[start - 1] != "\n":
        start = text.find("\n", start) + 1
        if start == 0:
            return None
    while True:
        ws = list(itertools.islice(_WORD.finditer(text, start), words))
        if len(ws) < words:
            return None
        s, e = ws[0].start(), ws[-1].end()
        lead = text[s:e]
        if text.count(lead) == 1:
            return lead, s, e
        start = text.find("\n", s) + 1
        if start == 0:
            return None


def make_probes(session, text: str, probes, depths, cont: int) -> tuple[list[Probe], list[str]]:
    """The document's probes, and a line for each one that cannot be made (no unique lead-in, too little text)."""
    out, skipped = [], []
    for kind in probes:
        if kind == "summary":
            out.append(Probe("summary", "summary", None, SUMMARY_QUESTION, None))
            continue
        for d in depths:
            q = quote_lead(text, d)
            if q is None:
                skipped.append(f"quote@{d}: no line after that depth starts a lead-in of {LEAD_WORDS} words found "
                               "once in the document")
                continue
            lead, s, e = q
            target = session.tokenize(text[e:e + 40 * cont])[:cont]
            if len(target) < cont:
                skipped.append(f"quote@{d}: {len(target)} tokens after the lead-in, fewer than --cont {cont}")
                continue
            out.append(Probe(f"quote@{d}", "quote", d, QUOTE_QUESTION.format(lead=lead), target, s))
    return out, skipped


def _greedy_continuation(session, first_logits, cont: int) -> tuple[list[np.ndarray], list[int], float]:
    """The full cache's own greedy answer: the log-probabilities before each of its tokens, the tokens (at most
    `cont`, an end of generation included) and the seconds."""
    logps, target, logits, t0 = [], [], first_logits, time.perf_counter()
    for i in range(cont):
        lp = log_softmax(logits)
        t = int(np.argmax(lp))
        logps.append(lp)
        target.append(t)
        if session.is_eog(t) or i + 1 == cont:
            break
        session.step({0: t})
        logits = session.logits(0)
    return logps, target, time.perf_counter() - t0


def run_fidelity_reselect(model_path, docs, policies: list[str], budgets: list[int], lengths: list[int] | None,
                          cont: int = 64, *, probes=PROBES, depths=DEFAULT_DEPTHS, cache_type: str = "f16",
                          policy_args: dict | None = None, threads: int | None = None, log=None,
                          doc_meta: dict | None = None, form: str = "reselect") -> dict:
    """Every document x length x probe x (policy, budget), re-selected (`form` "reselect") or compressed once for
    each probe ("aware"): the module's docstring. `docs`: .name and .text."""
    log = log or (lambda m: None)
    policy_args, doc_meta = policy_args or {}, doc_meta or {}
    if cont < 1:
        raise KvcliError("--cont must be >= 1")
    if form not in FORMS:
        raise KvcliError(f"--form: unknown form '{form}' (choose from once, {', '.join(FORMS)})")
    for p in probes:
        if p not in PROBES:
            raise KvcliError(f"--probes: unknown probe '{p}' (choose from {', '.join(PROBES)})")
    if "quote" in probes and not depths:
        raise KvcliError("--depths: the quote probe needs at least one depth")
    if TRUNCATE in policies:
        raise KvcliError("policy 'truncate' is for kvcli eval niah/ruler on documents read in chunks")
    unavailable, resolved = check_variants(model_path, policies, budgets, policy_args)
    cfgs = eval_configs(policies, budgets)
    run_keys = [k for k in cfgs if k[0] not in unavailable]
    tok = _session(model_path, 0, cache_type, threads)
    jobs = []   # (length label, document name, head tokens, [(probe, prompt tokens)], skipped lines)
    try:
        resident = form == "reselect" and not tok.info.sliding_layers
        for L in (lengths or [None]):
            for d in docs:
                text = d.text
                if L is not None:
                    toks = tok.tokenize(text)
                    if len(toks) < L:
                        jobs.append((L, d.name, None, [], [f"document too short: {len(toks)} tokens < {L}"]))
                        continue
                    text = tok.detokenize(toks[:L])
                ps, skipped = make_probes(tok, text, probes, depths, cont)
                head = tok.tokenize(prefix_text(tok, text, False))
                jobs.append((L if L is not None else "all", d.name, head,
                             [(p, tok.tokenize(render(tok, text, [], p.question))) for p in ps], skipped))
        n_ctx_train, n_layer = tok.n_ctx_train, tok.info.n_layer
    finally:
        tok.close()

    def extra(n: int) -> int:   # cells a prompt of n tokens is gathered into beside the resident document
        return 0 if form != "reselect" else max([_selection_cells(resolved[k], n_layer, n) for k in run_keys],
                                                default=0)

    for label, name, _, pp, _ in jobs:
        for p, prompt in pp:
            need = len(prompt) + cont + MARGIN + max(
                [resolved[k].observe[1] + resolved[k].spec.room_after(len(prompt), resolved[k].params)
                 for k in run_keys], default=0)
            if need > n_ctx_train:
                raise KvcliError(f"{name} ({label}): its probe {p.label} needs {need} cells, more than the model's "
                                 f"context ({n_ctx_train}): choose shorter documents or lengths")
    records, skips, t_start, where, interrupted = [], [], time.perf_counter(), machine(threads), False
    session, session_ctx, done = None, 0, 0
    colsum = any("colsum" in resolved[k].observe[0] for k in run_keys)
    try:
        for label, name, head, pp, skipped in jobs:
            done = len(records)
            base = {"task": "fidelity", "form": form, "doc": name, "length": label, "cont": cont,
                    "sample": 0, **doc_meta.get(name, {})}
            skips += [{"doc": name, "length": label, "why": why} for why in skipped]
            if not pp:
                continue
            need = pad_cells(max(len(q) + extra(len(q)) for _, q in pp) + cont + MARGIN + max(
                [resolved[k].observe[1] + resolved[k].spec.room_after(len(q), resolved[k].params)
                 for k in run_keys for _, q in pp], default=0))
            if session is None or session_ctx < need or session_ctx > 2 * need:
                if session is not None:
                    session.close()
                session = open_native(model_path, n_ctx=need, cache_type=cache_type, flash_attn=True,
                                      n_threads=threads, n_seq=RESIDENT_SEQ + 1 if resident else 1)
                session_ctx = need
            if form == "reselect":
                records += _document(session, base, head, pp, cfgs, run_keys, resolved, unavailable, colsum, cont,
                                     resident)
            else:
                records += _document_aware(session, {**base, "doc_tokens": len(head)}, pp, cfgs, resolved,
                                           unavailable, cont)
            log(f"fidelity {form} {name} ({len(head)} tokens): " + ", ".join(
                f"{p}{'' if b is None else '@' + str(b)} kl="
                + _mean([r.get("kl_mean") for r in records[done:] if (r["policy"], r["budget"]) == (p, b)])
                for p, b in cfgs))
    except KeyboardInterrupt:   # Ctrl-C: the documents scored whole are the result
        interrupted = True
        del records[done:]
    finally:
        if session is not None:
            session.close()
    return {"kind": "eval", "task": "fidelity", "model": str(model_path), "machine": where,
            "interrupted": interrupted,
            "settings": {"form": form, "policies": policies, "budgets": budgets, "lengths": lengths or "all",
                         "cont": cont, "probes": list(probes), "depths": list(depths), "lead_words": LEAD_WORDS,
                         "quote_question": QUOTE_QUESTION, "cache_type": cache_type,
                         "docs": [d.name for d in docs], "policy_args": policy_args, "mode": FORMS[form]},
            "elapsed_s": time.perf_counter() - t_start, "records": records, "skipped": skips,
            "summary": summarise(records),
            "summary_by_probe": summarise(records, keys=("task", "policy", "budget", "length", "probe_kind"))}


def _document(session, base, head, pp, cfgs, run_keys, resolved, unavailable, colsum, cont, resident) -> list[dict]:
    """One document's records: its full cache read once and stored (resident where the model allows, as kvcli chat
    holds it), then every probe re-selected for every configuration, the full cache first."""
    session.clear()
    store = StoredDocument.read(session, head, colsum=colsum,
                                **({"seq": RESIDENT_SEQ, "resident": True} if resident else {}))
    recs = []
    try:
        for probe, prompt in pp:
            pbase = {**_probe_base(base, probe, prompt), "doc_tokens": len(head),
                     "store_read_s": round(store.read_s, 3)}
            recs += [{**pbase, "policy": p, "budget": b, "status": unavailable[p], "ppl": None, "kl_mean": None,
                      "top1": None} for p, b in cfgs if p in unavailable]
            ref, target = None, probe.target
            for key, stats in _reselections(session, store, {k: prompt for k in run_keys},
                                            {k: resolved[k] for k in run_keys}):
                rec = {**pbase, "policy": key[0], "budget": key[1], "status": "ok", "ppl": None, "kl_mean": None,
                       "top1": None, **stats, **held(session)}
                try:
                    ref, target = _score(session, rec, session.logits(0), ref, target, cont)
                finally:
                    recs.append(rec)
                    session.clear(0)
    finally:
        if session.n_seq > QUESTION_SEQ:
            session.clear(QUESTION_SEQ)
        store.close()
    return recs


def _selection_cells(cfg, n_layer: int, n: int) -> int:
    """Cells a prompt of n tokens re-selected for `cfg` is gathered into: its widest layer's entries where the
    policy's layer schedule decides them (PolicySpec.widest: compresskv's calibrated layer budgets go past the
    budget; 1,748 cells at budget 1024 over ~2.4k tokens on qwen2.5-coder-0.5b), else the budget, never more than
    the prompt; and SELECTION_ROOM more."""
    b = cfg.budget or 0
    w = cfg.spec.widest(cfg.params, n_layer, n, b) if cfg.spec.widest is not None and cfg.compresses(n) else None
    return min(n, b if w is None else w) + SELECTION_ROOM


def _document_aware(session, base, pp, cfgs, resolved, unavailable, cont) -> list[dict]:
    """One document's records compressed once for each probe: its prompt prefilled once and compressed by every
    configuration in turn (runner.compressed_variants), the full cache first."""
    recs = []
    for probe, prompt in pp:
        pbase, ref, target = _probe_base(base, probe, prompt), None, probe.target
        for pol, bud, status, first, note, stats in compressed_variants(session, prompt, cfgs, resolved,
                                                                        unavailable):
            rec = {**pbase, "policy": pol, "budget": bud, "status": status, "ppl": None, "kl_mean": None,
                   "top1": None, **stats, **({"note": note} if note else {})}
            if status == "ok":
                ref, target = _score(session, rec, first, ref, target, cont)
            recs.append(rec)
    session.clear()
    return recs


def _probe_base(base: dict, probe: Probe, prompt: list[int]) -> dict:
    return {**base, "probe": probe.label, "probe_kind": probe.kind, "depth": probe.depth,
            "probe_offset": probe.offset, "prefix_tokens": len(prompt)}


def _score(session, rec: dict, first, ref, target, cont: int):
    """Score sequence 0's continuation into `rec` from `first` (its logits after the prompt) against `ref` (the full
    cache's log-probabilities): the probe's `target`, or (None, a summary) the full cache's own greedy answer when
    `rec` is the full cache's. Returns (ref, target) as the full cache leaves them for the configurations after it."""
    full = rec["policy"] == "full"
    try:
        if target is None and full:
            logps, target, secs = _greedy_continuation(session, first, cont)
        elif target is None:
            rec["status"] = "no continuation: the full cache's answer was not made"
            return ref, target
        else:
            logps, secs = _continuation(session, first, target)
    except KvcliError as e:
        rec["status"] = f"error: {e}"
        return ref, target
    if full:
        ref = logps
    rec.update(compare(ref, logps, target), cont=len(target), cont_s=round(secs, 3), target_tokens=list(target))
    return ref, target


def _mean(xs) -> str:
    xs = [x for x in xs if x is not None]
    return f"{np.mean(xs):.3f}" if xs else "-"
