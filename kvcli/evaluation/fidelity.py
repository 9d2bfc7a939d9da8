"""`kvcli eval fidelity`: a question-free measure of what compression loses, on any text (issue #63).

For each document and prefix length L, the first L tokens are prefilled once and compressed by every (policy,
budget) as `kvcli compress` compresses a document (question-agnostic: the observation window is the prefix's own
last tokens; one shared prefill, `kvcli.drivers.compress.Shared`); then the document's next `cont` tokens are fed
teacher-forced, one token a decode step, and the next-token distribution is read at every position. The full
cache of the same prefix, fed the same tokens, is the reference. Per position:

- KL(full || compressed) of the two next-token distributions, in nats (llama-perplexity's `--kl-divergence`);
- top-1 agreement: whether the two distributions' most likely tokens are the same (llama-perplexity's "same top");
- the log-probability of the document's own next token (perplexity of the continuation).

Summaries pool every scored position of every document of a (policy, budget, length): the mean KL with its
standard error (sample standard deviation / sqrt(positions)), the top-1 agreement with its binomial standard error,
the perplexity and its ratio to the full cache's on the same positions, and the K/V bytes the compressed cache held.
Positions of one document are not independent, so these standard errors are the spread of the positions, a lower
bound on the spread between documents; `per_doc` gives each document's own figures.

`lengths` None (`--lengths all`): each document's whole text but its last `cont` tokens is the prefix.

Past the context (a prefix + continuation longer than `max_context`, by default the model's trained context): the
full cache of the prefix cannot be held, so the reference is **the full cache of what fits**: the prefix's first
TRUNCATE_HEAD tokens and its last `max_context` - `cont` - MARGIN - TRUNCATE_HEAD (full attention over the most
recent context, as llama.cpp's `--keep` truncation keeps it), recorded as `full` with `past_context` and
`full_tokens`. The compressed caches read the whole prefix in chunks of `chunk`, compressed after each (bounded
reading, `kvcli run --chunk`: kvcli/drivers/chunked.py), and are scored on the same continuation. KL and top-1 then
say how far the compressed cache is from full attention over the last context's worth, not from an unbounded one;
the perplexity of the document's own continuation (`ppl`, `ratio_to_full`) says which of the two predicts the
document better.
"""
from __future__ import annotations

import math
import time

import numpy as np

from kvcli.errors import KvcliError
from kvcli.evaluation.measure import held, kl, log_softmax, machine
from kvcli.evaluation.corpus_eval import check_variants
from kvcli.drivers.chunked import DEFAULT_CHUNK
from kvcli.evaluation.runner import (TRUNCATE, TRUNCATE_HEAD, _session, chunked_variants, compressed_variants,
                                    eval_configs)

MARGIN = 16   # context cells beyond prefix + continuation


def _continuation(session, first_logits, target: list[int]) -> tuple[list[np.ndarray], float]:
    """Teacher-forced: the log-probabilities before each target token (the first from `first_logits`), and the
    seconds the steps took."""
    logps, logits = [], first_logits
    t0 = time.perf_counter()
    for i, t in enumerate(target):
        logps.append(log_softmax(logits))
        if i + 1 < len(target):
            session.step({0: t})
            logits = session.logits(0)
    return logps, time.perf_counter() - t0


def compare(ref: list[np.ndarray] | None, logps: list[np.ndarray], target: list[int]) -> dict:
    """Per-position figures of one configuration against the full cache's (`ref`; None: no reference)."""
    nll = [-float(lp[t]) for lp, t in zip(logps, target)]
    out = {"nll_positions": nll, "nll": float(np.mean(nll)), "ppl": math.exp(float(np.mean(nll))),
           "kl_positions": None, "top1_positions": None, "kl_mean": None, "top1": None}
    if ref is not None:
        kls = [kl(a, b) for a, b in zip(ref, logps)]
        same = [int(np.argmax(a) == np.argmax(b)) for a, b in zip(ref, logps)]
        out.update(kl_positions=kls, top1_positions=same, kl_mean=float(np.mean(kls)), top1=float(np.mean(same)))
    return out


def run_fidelity(model_path, docs, policies: list[str], budgets: list[int], lengths: list[int] | None,
                 cont: int = 64, *, cache_type: str = "f16", policy_args: dict | None = None,
                 threads: int | None = None, log=None, doc_meta: dict | None = None, chunk: int | None = None,
                 chunk_scoring: str = "question", max_context: int | None = None) -> dict:
    """Every document x length x (policy, budget): the module's docstring. `docs`: objects with .name and .text;
    `doc_meta`: name -> fields copied into its records (a corpus manifest's genre, split, tokens); `chunk`,
    `chunk_scoring`: the bounded reading's past the context (chunk None: DEFAULT_CHUNK); `max_context`: the context
    a full cache may take (the model's trained context; less to try the bounded reference where the whole cache
    would fit)."""
    log = log or (lambda m: None)
    policy_args = policy_args or {}
    doc_meta = doc_meta or {}
    if cont < 1:
        raise KvcliError("--cont must be >= 1")
    unavailable, resolved = check_variants(model_path, policies, budgets, policy_args)
    # `truncate` at budget b: full attention over the prefix's first TRUNCATE_HEAD and last b - TRUNCATE_HEAD tokens
    # (within the context: how far the reference past it is from the full cache)
    cfgs = eval_configs(policies, budgets, long=False)
    tok = _session(model_path, 0, cache_type, threads)
    try:
        doc_tokens = [(d.name, tok.tokenize(d.text)) for d in docs]
        n_ctx_train = tok.n_ctx_train
    finally:
        tok.close()
    records, t_start, where = [], time.perf_counter(), machine(threads)
    interrupted = False
    jobs = []   # (length label, prefix length, name, tokens)
    for L in (lengths or [None]):
        for name, toks in doc_tokens:
            jobs.append((L if L is not None else "all", L if L is not None else len(toks) - cont, name, toks))
    limit = max_context or n_ctx_train
    if limit > n_ctx_train:
        raise KvcliError(f"--max-context {limit} is more than the model's context ({n_ctx_train})")
    chunk = DEFAULT_CHUNK if chunk is None else chunk
    past_keep = limit - cont - MARGIN   # the reference's tokens past the context
    if any(L + cont + MARGIN > limit for _, L, _, _ in jobs):
        if past_keep < 2 * TRUNCATE_HEAD:
            raise KvcliError(f"--cont {cont} leaves the context of {limit} no room for a reference past it")
        if chunk == 0:
            raise KvcliError(f"--chunk 0: a prefix past the context ({limit} tokens) can only be read in chunks")
    session, session_ctx, done = None, 0, 0
    try:
        for label, L, name, toks in jobs:
            done = len(records)
            base = {"task": "fidelity", "doc": name, "length": label, "prefix_tokens": L, "cont": cont,
                    "depth": None, "sample": 0, "reference": "full", **doc_meta.get(name, {})}
            if L < 1 or len(toks) < L + cont:
                records += [{**base, "policy": p, "budget": b, "ppl": None, "kl_mean": None, "top1": None,
                             "status": f"document too short: {len(toks)} tokens < {max(L, 1)} + {cont}"}
                            for p, b in cfgs]
                continue
            past = L + cont + MARGIN > limit
            need = limit if past else L + cont + MARGIN
            if session is None or session_ctx < need or session_ctx > 2 * need:
                if session is not None:
                    session.close()
                session, session_ctx = _session(model_path, need, cache_type, threads), need
            prefix, target = toks[:L], toks[L:L + cont]
            ref = None
            if past:   # the reference: the full cache of what fits (the module's docstring); the rest read in chunks
                base.update(reference="context", past_context=True, chunk=chunk)
                variants = chunked_variants(session, prefix, [(TRUNCATE, past_keep) if c == ("full", None) else c
                                                              for c in cfgs], resolved, unavailable, chunk,
                                            cont + MARGIN, chunk_scoring)
            else:
                variants = compressed_variants(session, prefix, cfgs, resolved, unavailable)
            for i, (pol, bud, status, first, note, stats) in enumerate(variants):
                if past and i == 0:   # cfgs[0], the reference
                    pol, bud, stats = "full", None, {**stats, **held(session), "full_tokens": past_keep}
                elif pol == TRUNCATE and status == "ok":
                    stats = {**stats, **held(session)}
                rec = {**base, "policy": pol, "budget": bud, "status": status, "ppl": None, "kl_mean": None,
                       "top1": None, **stats}
                if note:
                    rec["note"] = note
                if status == "ok":
                    try:
                        logps, secs = _continuation(session, first, target)
                    except KvcliError as e:
                        rec.update(status=f"error: {e}")
                    else:
                        if pol == "full":
                            ref = logps
                        rec.update(compare(ref, logps, target), cont_s=round(secs, 3))
                records.append(rec)
            row = records[-len(cfgs):]
            log(f"fidelity {name} {L}+{cont}: " + ", ".join(
                f"{r['policy']}{'' if r['budget'] is None else '@' + str(r['budget'])} "
                f"kl={'-' if r.get('kl_mean') is None else round(r['kl_mean'], 3)} "
                f"top1={'-' if r.get('top1') is None else round(r['top1'], 2)}" for r in row))
    except KeyboardInterrupt:   # Ctrl-C: the documents scored whole are the result
        interrupted = True
        del records[done:]
    finally:
        if session is not None:
            session.close()
    return {"kind": "eval", "task": "fidelity", "model": str(model_path), "machine": where,
            "interrupted": interrupted,
            "settings": {"policies": policies, "budgets": budgets, "lengths": lengths or "all", "cont": cont,
                         "cache_type": cache_type, "docs": [n for n, _ in doc_tokens], "policy_args": policy_args,
                         "mode": "compress once (question-agnostic), continuation teacher-forced one token a step",
                         "max_context": limit, "chunk": chunk, "chunk_scoring": chunk_scoring,
                         "past_context_reference": f"the full cache of the first {TRUNCATE_HEAD} and last "
                                                   f"{past_keep - TRUNCATE_HEAD} tokens of the prefix"},
            "elapsed_s": time.perf_counter() - t_start, "records": records,
            "summary": summarise(records, keys=("task", "policy", "budget", "length", "reference"))}


def _se(values: list[float]) -> float | None:
    return float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else None


def summarise(records: list[dict], keys=("task", "policy", "budget", "length")) -> list[dict]:
    """Pooled over documents and positions per `keys` (the module's docstring); `ratio_to_full` is the perplexity
    against the full cache's on the same documents (and probes: fidelity_reselect.py)."""
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    # the reference a record is paired with: the full cache of its document, length and probe (past the context:
    # the full cache of what fits, `reference` "context")
    full_nll = {(r["doc"], r["length"], r.get("probe")): r["nll_positions"] for r in records
                if r["policy"] == "full" and r.get("nll_positions")}
    out = []
    for k, rs in groups.items():
        item = dict(zip(keys, k), n_docs=len(rs))
        bad = [r for r in rs if r.get("ppl") is None]
        if bad:
            item.update(status=bad[0]["status"], ppl=None, kl_mean=None, top1=None)
            out.append(item)
            continue
        nll = [x for r in rs for x in r["nll_positions"]]
        item.update(status="ok", positions=len(nll), ppl=math.exp(float(np.mean(nll))))
        ref = [full_nll.get((r["doc"], r["length"], r.get("probe"))) for r in rs]
        if all(x is not None for x in ref):
            item["full_ppl"] = math.exp(float(np.mean([x for xs in ref for x in xs])))
            item["ratio_to_full"] = item["ppl"] / item["full_ppl"]
        if all(r.get("kl_positions") is not None for r in rs):
            kls = [x for r in rs for x in r["kl_positions"]]
            same = [x for r in rs for x in r["top1_positions"]]
            p = float(np.mean(same))
            item.update(kl_mean=float(np.mean(kls)), kl_se=_se(kls), kl_max=float(np.max(kls)), top1=p,
                        top1_se=math.sqrt(p * (1 - p) / len(same)))
        for extra in ("kv_cells", "kv_bytes", "prefix_tokens"):
            vals = [r[extra] for r in rs if r.get(extra) is not None]
            if vals:
                item[extra] = float(np.mean(vals))
        out.append(item)
    return out


def fidelity_table(result: dict) -> str:
    """One row per configuration and length: KL mean +- standard error, top-1 agreement, perplexity ratio, held;
    re-selected (`--form reselect`), then the same per probe kind."""
    form = result["settings"].get("form")
    reselect = form in ("reselect", "aware")   # probes, the same table per probe kind
    how = {"reselect": "re-selected for each probe, its continuation",
           "aware": "compressed once for each probe (question-aware), its continuation"}.get(
        form, "compressed once, next")
    lines = [f"fidelity: {how} {result['settings']['cont']} tokens teacher-forced; KL(full || compressed) mean +- "
             "s.e. over positions, top-1 agreement with the full cache"]
    lines += _table_rows(result["summary"])
    if reselect:
        for kind in dict.fromkeys(r["probe_kind"] for r in result.get("summary_by_probe", [])):
            lines += ["", f"probe {kind}:"] + _table_rows([r for r in result["summary_by_probe"]
                                                           if r["probe_kind"] == kind])
    for s in result.get("skipped", []):
        lines.append(f"skipped: {s['doc']} ({s['length']}): {s['why']}")
    st = result["settings"]
    if any(r.get("reference") == "context" for r in result["summary"]):
        lines.append(f"past the context ({st['max_context']} tokens, rows marked 'past'): 'full' is "
                     f"{st['past_context_reference']}; the compressed caches read the prefix in chunks of "
                     f"{st['chunk']}")
    return "\n".join(lines)


def _table_rows(rows: list[dict]) -> list[str]:
    head = (f"{'policy':<22}{'length':>8}{'docs':>6}{'positions':>11}{'KL to full (nats)':>22}{'top-1 agreement':>20}"
            f"{'ppl / full':>12}{'K/V held':>12}")
    lines = [head, "-" * len(head)]
    for r in rows:
        name = r["policy"] if r["budget"] is None else f"{r['policy']}@{r['budget']}"
        name += " (past)" if r.get("reference") == "context" else ""
        if r.get("ppl") is None:
            lines.append(f"{name:<22}{str(r['length']):>8}{r['n_docs']:>6}  {str(r.get('status'))[:80]}")
            continue
        klc = "-" if r.get("kl_mean") is None else \
            f"{r['kl_mean']:.4f} +- {(r['kl_se'] or 0):.4f}"
        t1 = "-" if r.get("top1") is None else f"{100 * r['top1']:.1f}% +- {100 * r['top1_se']:.1f}"
        ratio = "-" if r.get("ratio_to_full") is None else f"{r['ratio_to_full']:.3f}"
        held = "-" if r.get("kv_bytes") is None else f"{r['kv_bytes'] / 2 ** 20:.2f} MiB"
        lines.append(f"{name:<22}{str(r['length']):>8}{r['n_docs']:>6}{r.get('positions', 0):>11}{klc:>22}{t1:>20}"
                     f"{ratio:>12}{held:>12}")
    return lines
