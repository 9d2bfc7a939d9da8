"""`kvcli eval chat`: many questions over one document, asked in one conversation (SCBench's multi-turn mode).

Each document is a station logbook (kvcli/evaluation/logbook.py) with `facts` facts planted at spread depths; its
questions are asked one after the other, each scored by string match of the planted value. Modes, on the same
documents and questions:

- `full`: the full cache, the conversation appended after the document (what a chat without compression does).
- `once`: compressed once before any question (question-agnostic: the document followed by kvcli's generic
  instruction, whose window scores the entries; `kvcli chat --compress-once`), then every question appended,
  with the earlier turns, after the compressed document.
- `alone`: the `once` cache, each question asked alone after it (its own turn after the generic instruction, without
  the earlier turns): a compressed-once file asked one question at a time.
- `context`: compressed once from the document alone, as kvpress's pipeline compresses its context (the template's
  head and the document, the user's turn left open: no instruction; a window policy's window is the document's
  end), each question then appended alone in that turn ("\n\n" and the question, the turn closed) and answered from
  it, the earlier ones dropped. The full cache on the same layout is among its configurations (kvpress's
  press=None). Read again for the mode: one prefill (and kvzip's reconstruction pass) serves every configuration
  (`Shared`).
- `reselect`: the document's full cache read once and stored; every question is answered from a cache
  re-selected for it (kvcli/drivers/reselect.py: `kvcli chat`'s default): restore, prefill the rest of the conversation
  with observation, plan, compact.
- `run`: question-aware compression of each question alone, without the conversation (`kvcli run` once per
  question): computed from the stored document, which observes what one prefill of the question's prompt observes
  (tests/test_reselect.py, L2 and L1), as `kvcli run --question Q1 --question Q2 ...` does. The upper mark of what
  per-question compression can score; against `reselect` it measures what the conversation's earlier turns cost.
- `bounded`: `reselect` in the bounded form (kvcli/drivers/reselect_bounded.py: `kvcli chat` above 256 MiB of full
  cache, past the context, or with --chunk N): per configuration the document is read by bounded reading (chunks
  of 1024 tokens) and stored chunk by chunk, and every question streams the stored chunks through a cache of the
  budget + a chunk. Not in the default modes: a read per configuration. Column-sum policies are not served bounded
  (no record). Each configuration gets the context `kvcli chat` would give it (kvcli/drivers/chunked.py
  `plan_chunking`), so a question streams what the chat's streams: the block index's chosen chunks, loaded together
  while they fit (kvcli/drivers/block_index.py). The only modes for a length past the model's context (positions
  re-indexed as bounded reading does).
- `bounded_all`: the bounded form before the block index (issue #46's "today"), from the same stored read as
  `bounded` when both are asked: every stored chunk streamed through a cache of the budget + one chunk, one probe
  per chunk.
- `reread`: the same, with the document read again for every question (one prefill per question serving every
  configuration): `run` as a loop of single-question `kvcli run` processes in one prefill would do it. Not in the
  default modes: it costs a read per question.

The document is read once per document for `full`, `once`, `alone`, `reselect` and `run` together: its full cache is
stored (kvcli/drivers/reselect.py) and each of them starts from it. `once` (and `alone`) re-selects once, for the
generic instruction (the agnostic prefix: the document followed by it, observed as one prefill of it observes,
tests/test_reselect.py), and appends the questions after that cache; `full` restores the whole document and appends
the conversation. `context` reads the document again (one prefill serving every configuration): its compressed
prompt is the stored prompt itself, with nothing after it for a re-selection to prefill and observe. `reread` reads
the document again for every question: one prefill per question serves every configuration (`Shared`).
Configurations that would re-select the same prompt with the same observation (the same policy at several budgets;
in `run`, `once` and `alone` every configuration's prompt is the same) share one restore and observed prefill
(`_reselections`): the prefilled sequence is saved, put back for each of the others and planned from the same
observation, as `Shared` does; their answers are those of separate re-selections (tests/test_eval_chat.py), their
records carry `shared` and the seconds of the restore and plan (`shared_s`) instead of `reselect_s`.
Decoding is greedy. The prompt of every mode is rendered with the model's own chat template, as the app renders it.
"""
from __future__ import annotations

import math
import time

import numpy as np

from kvcli.drivers import block_index
from kvcli.drivers.chunked import DEFAULT_CHUNK, pad_cells
from kvcli.drivers.compress import Shared, resolve
from kvcli.drivers.reselect import StoredDocument
from kvcli.drivers.reselect_bounded import check_usable
from kvcli.errors import KvcliError
from kvcli.evaluation import logbook as md
from kvcli.evaluation.measure import held, machine, peak_rss_bytes
from kvcli.evaluation.runner import _greedy, read_store_as_chat, reselect_in_form
from kvcli.evaluation.tasks import _fit, prefix_text, render, string_match_all
from kvcli.engines import open_native
from kvcli.planning.planner import make_plan

MODES = ("full", "once", "alone", "context", "reselect", "run", "reread", "bounded", "bounded_all")
BOUNDED = ("bounded", "bounded_all")    # served by one read per configuration (_mode_bounded)
DEFAULT_MODES = ("full", "once", "reselect", "run")
ROOM = 1024     # cells for the conversation after the document
SHARE = True    # configurations that re-select the same prompt alike share its restore and observed prefill


def make_chat_document(session, length: int, facts: int, seed: int) -> tuple[str, list[dict], int]:
    """A logbook of about `length` tokens (templated with its first question) with `facts` facts at depths
    (i + 0.5) / facts; returns (text, planted facts, tokens of the first question's prompt)."""
    depths = [round((i + 0.5) / facts, 3) for i in range(facts)]

    def build(words):
        text, planted = md.make_document(words, seed=seed, depths=depths)
        return render(session, text, [], planted[0]["question"]), (text, planted)

    _, n_tok, (text, planted) = _fit(build, length, lambda p: len(session.tokenize(p)), int(length / 1.35))
    return text, planted, n_tok


def ask(question: str) -> str:
    return f"{question} Answer with the number only."


def _record(mode, cfg_key, doc_i, q_i, fact, text, n_tokens, **extra) -> dict:
    return {"mode": mode, "policy": cfg_key[0], "budget": cfg_key[1], "doc": doc_i, "question": q_i,
            "depth": fact["depth"], "answer_expected": fact["answer"], "prediction": text.strip()[:80],
            "score": 100.0 * string_match_all(text, [fact["answer"]]), "n_tokens": n_tokens, **extra}


def run_chat_eval(model_path, policies: list[str], budgets: list[int], lengths: list[int], documents: int,
                  facts: int = 6, modes=DEFAULT_MODES, *, cache_type: str = "f16", policy_args: dict | None = None,
                  threads: int | None = None, seed: int = 0, max_tokens: int = 12, first_document: int = 0,
                  log=None) -> dict:
    log = log or (lambda m: None)
    policy_args = policy_args or {}
    for m in modes:
        if m not in MODES:
            raise KvcliError(f"unknown mode '{m}': choose from {', '.join(MODES)}")
    if documents < 1 or facts < 1 or first_document < 0:
        raise KvcliError("--documents and --facts must be >= 1, --from-document >= 0")
    keys = [(p, b) for p in policies if p != "full" for b in budgets]
    cfgs = {k: resolve(model_path, k[0], k[1], policy_args.get(k[0], {})) for k in keys}
    full = resolve(model_path, "full", None)
    tok = open_native(model_path, n_ctx=0, cache_type=cache_type, n_threads=threads)
    records, reads, t_start, interrupted = [], [], time.perf_counter(), False
    try:
        for L in lengths:
            bounded_only = set(modes) <= set(BOUNDED)
            if L + ROOM > tok.n_ctx_train and not bounded_only:
                raise KvcliError(f"length {L} + {ROOM} conversation cells exceed the model's context "
                                 f"({tok.n_ctx_train}): re-selection keeps the document's full cache (only the "
                                 f"modes {', '.join(BOUNDED)} read past it)")
            # bounded modes size the context per configuration, as kvcli chat does (_mode_bounded)
            # reselect / run: the document resident in RESIDENT_SEQ, each question prefilled in QUESTION_SEQ and its
            # selection gathered into sequence 0 beside it (kvcli/drivers/resident.py), as kvcli chat answers
            resident = bool(set(modes) & {"reselect", "run"}) and not tok.info.sliding_layers
            beside = max((b or 0 for b in budgets), default=0) + 128 if resident else 0
            session = open_native(model_path, n_ctx=pad_cells(min(L, DEFAULT_CHUNK) if bounded_only
                                                              else L + ROOM + beside),
                                  cache_type=cache_type, n_threads=threads,
                                  n_seq=RESIDENT_SEQ + 1 if resident else 2 if set(modes) & set(BOUNDED) else 1)
            try:
                for d in range(first_document, first_document + documents):
                    doc_seed = seed * 1000 + d
                    text, planted, n_tok = make_chat_document(tok, L, facts, doc_seed)
                    log(f"[{L} tokens, document {d + 1}/{first_document + documents}: {n_tok} tokens, {facts} "
                        "questions]")
                    store = None
                    if set(modes) & {"full", "once", "alone", "reselect", "run"}:
                        session.clear()
                        store = StoredDocument.read(session, session.tokenize(prefix_text(session, text, False)),
                                                    colsum=any("colsum" in c.observe[0] for c in cfgs.values()))
                        reads.append({"length": L, "doc": d, "mode": "store", "read_s": round(store.read_s, 3),
                                      "store_bytes": store.nbytes, "stored_tokens": store.split})
                    try:
                        for mode in modes:
                            t0 = time.perf_counter()
                            if mode in BOUNDED:   # every bounded form asked, from one read per configuration
                                if mode != next(m for m in modes if m in BOUNDED):
                                    continue
                                out = _mode_bounded(session, text, planted, cfgs, full, max_tokens, store,
                                                    forms=[m for m in modes if m in BOUNDED])
                            else:
                                out = MODE_RUNNERS[mode](session, text, planted, cfgs, full, max_tokens, store)
                            for r in out["records"]:
                                r.update(length=L, doc=d, doc_tokens=n_tok)
                            records += out["records"]
                            if "read_s" in out:
                                reads.append({"length": L, "doc": d, "mode": mode, "read_s": round(out["read_s"], 3)})
                            done = sorted({(r["mode"], r["policy"], r["budget"]) for r in out["records"]},
                                          key=lambda k: (MODES.index(k[0]), k[1], k[2] or 0))
                            log(f"  {mode}: {time.perf_counter() - t0:.1f}s, " + ", ".join(
                                f"{'' if m == mode else m + ' '}{p}{'' if b is None else f'@{b}'} "
                                + format(np.mean([r["score"] for r in out["records"]
                                                  if (r["mode"], r["policy"], r["budget"]) == (m, p, b)]), ".0f")
                                for m, p, b in done))
                    finally:
                        if store is not None:
                            store.close()
            finally:
                session.close()
    except KeyboardInterrupt:
        interrupted = True
    tok.close()
    return {"kind": "chat", "model": str(model_path), "policies": policies, "budgets": budgets, "lengths": lengths,
            "documents": documents, "first_document": first_document, "facts": facts, "modes": list(modes),
            "cache_type": cache_type, "records": records, "reads": reads, "summary": summarise(records),
            "machine": machine(threads), "peak_rss_bytes": peak_rss_bytes(),
            "seconds": round(time.perf_counter() - t_start, 1), "interrupted": interrupted}


# ------------------------------------------------------------------------------ the modes
def _mode_full(session, text, planted, cfgs, full, max_tokens, store):
    """The full cache with the conversation appended: `once` with the full cache."""
    return _mode_once(session, text, planted, {("full", None): full}, full, max_tokens, store, mode="full")


def _answer_after(session, prefix: str, prompt: str, mark: int, max_tokens: int) -> tuple[str, dict]:
    """Drop sequence 0's cells from `mark` (what followed the compressed `prefix`), prefill the rest of `prompt` after
    it and answer greedily: (answer, the record's seconds and cells)."""
    if not prompt.startswith(prefix):
        raise KvcliError("the chat template does not extend the compressed prefix")
    session.truncate(0, mark)
    t1 = time.perf_counter()
    session.prefill(session.tokenize(prompt[len(prefix):]), seq=0)
    t2 = time.perf_counter()
    answer = _greedy(session, session.logits(0), max_tokens)
    return answer, {"question_prefill_s": round(t2 - t1, 4), "answer_s": round(time.perf_counter() - t2, 4),
                    **held(session)}


def _mode_once(session, text, planted, cfgs, full, max_tokens, store, mode="once", history_kept=True):
    prefix = prefix_text(session, text, agnostic=True)
    tokens = session.tokenize(prefix)
    recs = []
    # compressed for the generic instruction, before any question
    for key, shared in _reselections(session, store, {k: tokens for k in cfgs}, cfgs):
        mark = session.seq(0).next_pos
        history = []
        for i, fact in enumerate(planted):
            q = ask(fact["question"])
            answer, stats = _answer_after(session, prefix, render(session, text, history, q, agnostic=True), mark,
                                          max_tokens)
            recs.append(_record(mode, key, 0, i, fact, answer, len(tokens), **stats,
                                **({"shared": True} if "shared_s" in shared else {})))
            if history_kept:
                history.append((q, answer.strip()))
        session.clear(0)
    return {"records": _in_order(recs, cfgs)}


def _mode_alone(session, text, planted, cfgs, full, max_tokens, store):
    return _mode_once(session, text, planted, cfgs, full, max_tokens, store, mode="alone", history_kept=False)


def _mode_context(session, text, planted, cfgs, full, max_tokens, store):
    prefix = prefix_text(session, text, agnostic=False)
    tokens = session.tokenize(prefix)
    every = {("full", None): full, **cfgs}
    session.clear()
    t0 = time.perf_counter()
    shared = Shared(session, tokens, list(every.values()), planner="native")
    read_s = time.perf_counter() - t0
    if shared.error is not None:
        raise shared.error
    recs = []
    for key, cfg in every.items():
        applied = shared.apply(cfg)
        if applied.error is not None:
            raise applied.error
        mark = session.seq(0).next_pos
        extra = {} if applied.plan is None else {"compress_s": round(applied.compress_s, 4),
                                                 "reconstruct_s": applied.reconstruct_s}
        for i, fact in enumerate(planted):
            answer, stats = _answer_after(session, prefix, render(session, text, [], ask(fact["question"])), mark,
                                          max_tokens)
            recs.append(_record("context", key, 0, i, fact, answer, len(tokens), **stats, **extra))
    session.clear(0)
    return {"records": recs, "read_s": read_s}


QUESTION_SEQ, RESIDENT_SEQ = 2, 3   # the resident path's sequences (the answer's is 0, a bounded mode's spare 1)


def _mode_reselect(session, text, planted, cfgs, full, max_tokens, store, mode="reselect"):
    if session.n_seq > RESIDENT_SEQ:   # held once for every question of this mode, freed for the next mode
        store.make_resident(session, RESIDENT_SEQ)
    try:
        return _questions_reselected(session, text, planted, cfgs, max_tokens, store, mode)
    finally:
        session.clear(QUESTION_SEQ)
        store.evict(session)


def _questions_reselected(session, text, planted, cfgs, max_tokens, store, mode):
    recs, histories = [], {key: [] for key in cfgs}
    for i, fact in enumerate(planted):
        q = ask(fact["question"])
        prompts = {key: session.tokenize(render(session, text, histories[key] if mode == "reselect" else [], q))
                   for key in cfgs}
        for key, stats in _reselections(session, store, prompts, cfgs):
            t2 = time.perf_counter()
            answer = _greedy(session, session.logits(0), max_tokens)
            recs.append(_record(mode, key, 0, i, fact, answer, len(prompts[key]), **stats,
                                answer_s=round(time.perf_counter() - t2, 4),
                                **held(session)))
            histories[key].append((q, answer.strip()))
            session.clear(0)
    return {"records": _in_order(recs, cfgs)}


def _share_key(store, prompt, cfg, key):
    """Configurations with the same key re-select `prompt` identically up to their plans: the same restored entries
    and the same observed prefill. A configuration that does not compress it (nothing observed, no plan to
    share) or whose re-selection fails (its own error is raised by StoredDocument.reselect) is alone."""
    n = len(prompt)
    try:
        if SHARE and cfg.compresses(n):
            kinds, window = cfg.observe
            return (tuple(prompt), store.restore_point(n, cfg), tuple(sorted(kinds)), window)
    except KvcliError:
        pass
    return ("alone", key)


def _reselections(session, store, prompts: dict, cfgs: dict):
    """For each configuration (key -> cfg; prompts: key -> its prompt's tokens), leave sequence 0 holding its
    prompt re-selected for it and yield (key, stats) for the caller to answer before the next. The first of a group
    of configurations that observe alike (`_share_key`) re-selects (StoredDocument.reselect; stats: reselect_s,
    reselect_prefilled); its prefilled sequence is saved before the plan is applied, and each other one of the group
    gets it back and plans from the same observation (stats: shared_s, the seconds of that, and shared)."""
    groups: dict = {}
    for key, cfg in cfgs.items():
        groups.setdefault(_share_key(store, prompts[key], cfg, key), []).append(key)
    for keys in groups.values():
        seen: dict = {}

        def grab(obs, plan, seen=seen, share=len(keys) > 1):   # noqa: B008 (binds this group's values)
            if share:
                seen.update(obs=obs, state=session.save_seq(0))

        resident = store.resident is not None
        if resident:   # the question's prefilled sequence stays: each plan of the group is gathered from it
            grab = (lambda obs, plan, seen=seen: seen.update(obs=obs))   # noqa: E731
            session.clear(QUESTION_SEQ)
        r = store.reselect(session, prompts[keys[0]], cfgs[keys[0]], on_step=grab,
                           **({"seq": QUESTION_SEQ, "into": 0} if resident else {}))
        if resident and r.seq != 0:   # nothing gathered (a configuration that keeps the whole prompt)
            session.clear(0)
            session.move_seq(QUESTION_SEQ, 0)
        yield keys[0], {"reselect_s": round(r.total_s, 4), "reselect_prefilled": r.prefilled}
        for key in keys[1:]:
            cfg, t0 = cfgs[key], time.perf_counter()
            plan = make_plan(cfg.spec, cfg.params, cfg.budget, seen["obs"], session.engine)
            if resident:
                session.clear(0)
                session.gather(plan, QUESTION_SEQ, 0)
            else:
                session.restore_seq(seen["state"], 0)
                session.apply_plan(plan, seq=0)
            yield key, {"shared_s": round(time.perf_counter() - t0, 4), "reselect_prefilled": r.prefilled,
                        "shared": True}
        seen.clear()
        if resident:
            session.clear(QUESTION_SEQ)


def _in_order(recs: list[dict], cfgs: dict) -> list[dict]:
    """Records in the configurations' order, then the questions' (as a loop over configurations gives them)."""
    order = {key: i for i, key in enumerate(cfgs)}
    return sorted(recs, key=lambda r: (order[(r["policy"], r["budget"])], r["question"]))


def _mode_run(session, text, planted, cfgs, full, max_tokens, store):
    return _mode_reselect(session, text, planted, cfgs, full, max_tokens, store, mode="run")


def _mode_reread(session, text, planted, cfgs, full, max_tokens, store):
    recs = []
    for i, fact in enumerate(planted):
        q = ask(fact["question"])
        tokens = session.tokenize(render(session, text, [], q))
        session.clear()
        t0 = time.perf_counter()
        shared = Shared(session, tokens, list(cfgs.values()), planner="native")
        prefill_s = time.perf_counter() - t0
        if shared.error is not None:
            raise shared.error
        for key, cfg in cfgs.items():
            applied = shared.apply(cfg)
            if applied.error is not None:
                raise applied.error
            answer = _greedy(session, shared.first, max_tokens)
            recs.append(_record("reread", key, 0, i, fact, answer, len(tokens), read_s=round(prefill_s, 3),
                                **held(session)))
    return {"records": recs}


def _mode_bounded(session, text, planted, cfgs, full, max_tokens, store, forms=("bounded",)):
    """Per configuration: the document read by bounded reading into a store, in the context `kvcli chat` gives that
    policy and budget, then the questions in one conversation per form (`bounded`: as kvcli chat streams them;
    `bounded_all`: every chunk, one probe each). The context is put back as it was after."""
    head = session.tokenize(prefix_text(session, text, False))
    n_ctx0, asked, recs = session.n_ctx, session.cache_type, []
    for key, cfg in cfgs.items():
        try:
            check_usable(session, cfg, 1)
        except KvcliError:
            continue
        cs, chunk = read_store_as_chat(session, head, cfg, default_chunk=DEFAULT_CHUNK, cache_type=asked)
        try:
            for form in forms:
                history = []
                for i, fact in enumerate(planted):
                    q = ask(fact["question"])
                    prompt = session.tokenize(render(session, text, history, q))
                    r = reselect_in_form(cs, session, prompt, cfg, chunk, form == "bounded_all")
                    t2 = time.perf_counter()
                    answer = _greedy(session, session.logits(0), max_tokens)
                    recs.append(_record(form, key, 0, i, fact, answer, len(prompt), reselect_s=round(r.total_s, 4),
                                        reselect_prefilled=r.prefilled, reselect_chunks=r.chunks,
                                        stored_chunks=r.stored, index_s=round(r.index_s, 4),
                                        read_s=round(cs.read_s, 3), answer_s=round(time.perf_counter() - t2, 4),
                                        store_bytes=cs.nbytes, read_resumed_tokens=cs.resumed_tokens,
                                        chunk_type=cs.chunk_type, n_ctx=session.n_ctx, **held(session),
                                        **({"index_candidates": block_index.CANDIDATES} if form == "bounded" else {})))
                    history.append((q, answer.strip()))
                    session.clear(0)
        finally:
            cs.close()
    session.clear()
    session.use_cache_type(asked)   # a q8_0 store was read in float16
    if session.n_ctx != n_ctx0:
        session.resize_context(n_ctx0)
    return {"records": recs}


MODE_RUNNERS = {"full": _mode_full, "once": _mode_once, "alone": _mode_alone, "context": _mode_context,
                "reselect": _mode_reselect, "run": _mode_run,
                "reread": _mode_reread}   # the bounded modes: _mode_bounded, every form asked at once


# ------------------------------------------------------------------------------ results
def summarise(records: list[dict]) -> list[dict]:
    """Per length x mode x policy x budget: mean score over every question of every document, its standard
    error (questions as the unit), and the mean seconds per question where measured."""
    groups: dict = {}
    for r in records:
        groups.setdefault((r["length"], r["mode"], r["policy"], r["budget"]), []).append(r)
    out = []
    for (L, mode, pol, bud), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], MODES.index(kv[0][1]),
                                                                           kv[0][2], kv[0][3] or 0)):
        s = np.array([r["score"] for r in rs], np.float64)
        row = {"length": L, "mode": mode, "policy": pol, "budget": bud, "questions": len(rs),
               "documents": len({r["doc"] for r in rs}), "score": round(float(s.mean()), 1),
               "stderr": round(float(s.std(ddof=1) / math.sqrt(len(s))), 1) if len(s) > 1 else None}
        for k in ("reselect_s", "answer_s", "question_prefill_s"):
            v = [r[k] for r in rs if k in r]
            if v:
                row[k] = round(float(np.mean(v)), 3)
        for k in ("kv_bytes", "kv_bytes_live"):   # the memory the answers cost, held and live (mean per question)
            v = [r[k] for r in rs if k in r]
            if v:
                row[k] = int(np.mean(v))
        out.append(row)
    return out


def chat_table(result: dict) -> str:
    lines = [f"{'length':>6} {'mode':>9} {'policy':>12} {'budget':>6} {'score':>6} {'s.e.':>5} {'n':>4} "
             f"{'s/question':>10} {'MB held':>8}"]
    for r in result["summary"]:
        per_q = r.get("reselect_s", 0) + r.get("answer_s", 0) if "reselect_s" in r else \
            r.get("question_prefill_s", 0) + r.get("answer_s", 0) if "answer_s" in r else None
        held_mb = f"{r['kv_bytes'] / 1e6:.2f}" if "kv_bytes" in r else "-"
        lines.append(f"{r['length']:>6} {r['mode']:>9} {r['policy']:>12} {r['budget'] or '-':>6} {r['score']:>6.1f} "
                     f"{r['stderr'] if r['stderr'] is not None else '-':>5} {r['questions']:>4} "
                     f"{'-' if per_q is None else f'{per_q:.2f}':>10} {held_mb:>8}")
    for x in result.get("reads", []):
        lines.append(f"read of document {x['doc']} at {x['length']} ({x['mode']}): {x['read_s']:.1f}s"
                     + (f", stored {x['store_bytes'] / 1e6:.1f} MB" if x.get("store_bytes") else ""))

    return "\n".join(lines)


def plot_chat(result: dict, path: str) -> None:
    """Score per policy and budget, one bar per mode, one panel per length."""
    from kvcli.evaluation.report import pyplot, save_png  # noqa: PLC0415
    plt = pyplot()
    lengths = sorted({r["length"] for r in result["summary"]})
    fig, axes = plt.subplots(1, len(lengths), figsize=(6 * len(lengths), 4), squeeze=False)
    for ax, L in zip(axes[0], lengths):
        rows = [r for r in result["summary"] if r["length"] == L]
        full = [r for r in rows if r["mode"] == "full"]
        keys = sorted({(r["policy"], r["budget"]) for r in rows if r["mode"] != "full"}, key=lambda k: (k[0], k[1]))
        modes = [m for m in ("once", "alone", "context", "reselect", "run", "reread")
                 if any(r["mode"] == m for r in rows)]
        width = 0.8 / max(1, len(modes))
        for j, m in enumerate(modes):
            ys, es = [], []
            for k in keys:
                hit = [r for r in rows if r["mode"] == m and (r["policy"], r["budget"]) == k]
                ys.append(hit[0]["score"] if hit else np.nan)
                es.append((hit[0]["stderr"] or 0) if hit else 0)
            ax.bar(np.arange(len(keys)) + j * width, ys, width, yerr=es, label=m, capsize=2)
        if full:
            ax.axhline(full[0]["score"], color="k", linestyle="--", label="full cache")
        ax.set_xticks(np.arange(len(keys)) + 0.4 - width / 2)
        ax.set_xticklabels([f"{p}\n{b}" for p, b in keys], fontsize=7)
        ax.set_ylim(0, 105)
        ax.set_title(f"{L} tokens, {result['documents']} documents x {result['facts']} questions")
        ax.set_ylabel("correct answers (%)")
        ax.legend(fontsize=7)
    save_png(fig, path)
