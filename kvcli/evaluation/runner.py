"""`kvcli eval`: NIAH, RULER-style tasks and fidelity, per policy x budget x length.

Every sample is scored with the full cache first and then with each policy x budget on the very same
prompt, so each score can also be given as a fraction of the full cache's score on the same samples
(the papers' headline form). One prefill per sample serves all configurations (see
`compressed_variants`); prefill, planning and compaction are those of the driver, `kvcli.drivers.compress`.
Decoding is greedy.

Question-agnostic mode (`agnostic`, `kvcli eval niah|ruler --agnostic`): the document is compressed before its
question is seen, as `kvcli chat --compress-once` compresses it. Each prompt is laid out as eval chat's `once` mode
lays it out (`render` / `prefix_text` of kvcli/evaluation/tasks.py): the agnostic prefix (chat template head, the
document and kvcli's generic instruction, kvcli.templating.GENERIC_SUFFIX, in one user turn) is prefilled and
compressed by every configuration (one prefill, `Shared`, serves them all; kvzip's reconstruction pass runs once),
then the question follows as the next user turn, with the assistant turn and the task's answer prefix, and is
answered greedily from the compressed cache.

Stored mode (`stored`, `kvcli eval niah|ruler --stored`): as `kvcli chat` answers over a book. The agnostic prefix
is read once per configuration by bounded reading into a store of every chunk (kvcli/drivers/reselect_bounded.py,
in the context kvcli chat gives that policy and budget), then the question is answered twice from that one store:
form `index`, the chunks the block index chooses re-selected for the question (kvcli chat today), and form
`every_chunk`, every stored chunk streamed through budget + one chunk with a probe each (kvcli before the index).
"""
from __future__ import annotations

import codecs
import time
from pathlib import Path

import numpy as np

from kvcli.drivers.bench import availability
from kvcli.drivers.chunked import (DEFAULT_CHUNK, TURN_ROOM, check_chunk, check_fits, pad_cells, plan_chunking,
                                   read_in_float16_note, reading_cache_type)
from kvcli.drivers.compress import Shared, prefill_and_compress, resolve
from kvcli.drivers.reselect import STORE_TAIL
from kvcli.drivers.reselect_bounded import ChunkedStore, store_types
from kvcli.engines import ContextFull, open_native
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import held, machine
from kvcli.evaluation.tasks import RULER_TASKS, TASKS, niah_sample, prefix_text, render, ruler_sample, string_match_all
from kvcli.generate import Sampler

DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
TRUNCATE = "truncate"     # the baseline for documents longer than the context: keep the head and the last tokens
TRUNCATE_HEAD = 32        # prompt tokens kept from the start (chat template + title), as llama.cpp's --keep
AGNOSTIC_LAYOUT = ("question-agnostic: [template head, document, generic instruction] prefilled and compressed, then "
                   "[next user turn: the question; assistant turn; answer prefix] prefilled after the compressed "
                   "cache (eval chat's once layout)")
STORED_FORMS = ("index", "every_chunk")   # stored mode: the block index's chosen chunks; every chunk, a probe each


def eval_configs(policies: list[str], budgets: list[int], long: bool = True) -> list[tuple[str, int | None]]:
    """(policy, budget) pairs, full first; `truncate` runs once per budget (the same memory as the compressed
    caches) and, for documents read in chunks (`long`), once with the context's worth of tokens (for a prompt
    that fits the context that would be the full cache)."""
    out = [("full", None)]
    for p in policies:
        for b in ([None] if p == "full" else [*([None] if long else []), *budgets] if p == TRUNCATE else budgets):
            if (p, b) not in out:
                out.append((p, b))
    return out


def _check_policies(model_path, policies, budgets, policy_args) -> tuple[dict, dict]:
    """(unavailable, resolved): the policies this library cannot run, reported per result, and every other
    configuration eval_configs can make of them resolved once for the model ((policy, budget) -> Compression),
    which every sample takes as it is; bad arguments stop the run before it starts, in resolve's one message."""
    why, resolved = {}, {}
    for p, b in eval_configs(policies, budgets):
        if p == TRUNCATE or p in why:
            continue
        w = availability(p)
        if w:
            why[p] = w
        else:
            resolved[(p, b)] = resolve(model_path, p, b, policy_args.get(p, {}))
    return why, resolved


def _session(model_path, n_ctx, cache_type, threads):
    return open_native(model_path, n_ctx=n_ctx, cache_type=cache_type, flash_attn=True, n_threads=threads)


def compressed_variants(session, tokens: list[int], cfgs, resolved: dict, unavailable: dict):
    """For each (policy, budget) of `cfgs` (`resolved`: their Compressions, from `_check_policies`), leave
    sequence 0 of `session` holding `tokens` compressed by it, and yield (policy, budget, status, first_logits,
    note, stats); decode from seq 0 before the next item.
    stats: the shared prefill's seconds (`prefill_s`), the configuration's planning + applying (`compress_s`,
    kvzip's reconstruction pass included), kvzip's pass alone (`reconstruct_s`) and the compressed cache's
    cells and K/V bytes held and live (`kv_cells`, `kv_bytes`, `kv_bytes_live`).

    One prefill serves every configuration of a sample (`kvcli.drivers.compress.Shared`): the observation is captured
    once with the union of what the policies need (one window sum per window length the policies use: a
    policy with window w plans from the sums over the last w queries), the uncompressed state is saved, and
    each configuration restores it, plans with the native planner and applies its plan. `kvcli bench` shares
    a prefill only between configurations that observe alike: it times each prefill.
    `truncate` at budget b is its own prefill of the b tokens `truncated` keeps, after the shared ones.
    """
    session.clear()
    shared = Shared(session, tokens, [resolved[c] for c in cfgs if c[0] not in unavailable and c[0] != TRUNCATE],
                    planner="native")
    for pol, bud in sorted(cfgs, key=lambda c: c[0] == TRUNCATE):
        if pol in unavailable:
            yield pol, bud, unavailable[pol], None, "", {}
            continue
        if pol == TRUNCATE:
            session.clear()
            session.prefill(truncated(tokens, bud), seq=0)
            yield pol, bud, "ok", session.logits(0), "", {}
            continue
        applied = shared.apply(resolved[(pol, bud)])
        if applied.error is None:
            stats = {"prefill_s": round(shared.prefill_s, 4), "compress_s": round(applied.compress_s, 4),
                     **held(session)}
            if applied.reconstruct_s is not None:
                stats["reconstruct_s"] = round(applied.reconstruct_s, 4)
            yield pol, bud, "ok", shared.first, applied.note, stats
        elif isinstance(applied.error, KvcliError):
            yield pol, bud, f"error: {applied.error}", None, "", {}
        else:
            raise applied.error


def truncated(tokens: list[int], keep: int) -> list[int]:
    """Plain truncation: the first TRUNCATE_HEAD tokens (chat template, title) and the last `keep` - TRUNCATE_HEAD."""
    if len(tokens) <= keep:
        return list(tokens)
    return list(tokens[:TRUNCATE_HEAD]) + list(tokens[len(tokens) - (keep - TRUNCATE_HEAD):])


def chunked_variants(session, tokens: list[int], cfgs, resolved: dict, unavailable: dict, chunk: int,
                     reserve: int, scoring: str = "question"):
    """As `compressed_variants`, for documents read in chunks (kvcli/drivers/chunked.py): each configuration reads
    the whole prompt itself (chunked prefills cannot be shared: what is kept decides what later chunks
    attend to). `full` runs only when the prompt fits the context; `truncate` keeps the context's worth
    (budget None) or `budget` tokens. Yields (policy, budget, status, first_logits, note, stats)."""
    n_ctx = session.n_ctx
    asked = session.cache_type
    try:
        for pol, bud in cfgs:
            if pol in unavailable:
                yield pol, bud, unavailable[pol], None, "", {}
                continue
            # a quantised cache is read in float16 as kvcli run reads it (chunked.requantises); the others as asked
            reading = asked if pol in ("full", TRUNCATE) else reading_cache_type(session.info, asked)
            _use_cache_type(session, reading, n_ctx)
            yield _chunked_variant(session, tokens, pol, bud, resolved, chunk, reserve, scoring, n_ctx,
                                   read_in_float16_note(asked) if reading != asked else "")
    finally:
        _use_cache_type(session, asked, n_ctx)


def _use_cache_type(session, cache_type: str | None, n_ctx: int) -> None:
    if session.cache_type != cache_type:
        session.clear()
        session.use_cache_type(cache_type)
        session.create_context(n_ctx)


def _chunked_variant(session, tokens, pol, bud, resolved, chunk, reserve, scoring, n_ctx, note):
    """One configuration of `chunked_variants`: (policy, budget, status, first_logits, note, stats)."""
    n = len(tokens)
    session.clear()
    try:
        if pol == "full" or pol == TRUNCATE:
            keep = n if pol == "full" else (bud or n_ctx - reserve)
            if keep + reserve > n_ctx:
                return pol, bud, f"not run: {n} tokens do not fit the context ({n_ctx})", None, "", {}
            toks = truncated(tokens, keep)
            session.prefill(toks, seq=0)
            stats = {"kv_cells": len(toks), "peak_kv_cells": len(toks)}
        else:
            rep = prefill_and_compress(session, tokens, resolved[(pol, bud)], seq=0, chunk=chunk, cap=bud + chunk,
                                       scoring=scoring)
            stats = {**held(session), **rep.as_stats()}
    except KvcliError as e:
        return pol, bud, f"error: {e}", None, note, {}
    return pol, bud, "ok", session.logits(0), note, stats


def agnostic_split(session, s) -> tuple[list[int], list[int]]:
    """The question-agnostic layout of sample `s` as token ids: (prefix, question). The prefix is the chat
    template's head, the document and kvcli's generic instruction (eval chat's `once` prefix, tasks.prefix_text);
    the question is the next user turn, the assistant turn and the answer prefix (tasks.render's rest)."""
    if not s.document:
        raise KvcliError(f"task {s.task} has no question-agnostic layout")
    prefix = prefix_text(session, s.document, agnostic=True)
    full = render(session, s.document, [], s.question, agnostic=True) + s.answer_prefix
    if not full.startswith(prefix):
        raise KvcliError("the chat template does not extend the agnostic prefix")
    return session.tokenize(prefix), session.tokenize(full[len(prefix):])


def sample_variants(session, toks, question, cfgs, resolved, unavailable, *, reserve: int, chunk=None,
                    chunk_scoring="question"):
    """The configurations of one prompt: `toks` compressed by each (in chunks when `chunk`), and, question-agnostic,
    the `question` tokens prefilled after the compressed cache. Yields (policy, budget, status, first_logits, note,
    stats), seq 0 ready to decode from first_logits."""
    variants = chunked_variants(session, toks, cfgs, resolved, unavailable, chunk, reserve + len(question or ()),
                                chunk_scoring) if chunk else \
        compressed_variants(session, toks, cfgs, resolved, unavailable)
    for pol, bud, status, first, note, stats in variants:
        if status == "ok" and question:
            t0 = time.perf_counter()
            try:
                session.prefill(question, seq=0)
            except (KvcliError, ContextFull) as e:
                yield pol, bud, f"error: {e}", None, note, stats
                continue
            stats = {**stats, "question_prefill_s": round(time.perf_counter() - t0, 4)}
            first = session.logits(0)
        yield pol, bud, status, first, note, stats


def read_store_as_chat(session, head: list[int], cfg, chunk: int | None = None,
                       default_chunk: int = DEFAULT_CHUNK, cache_type: str | None = None,
                       kept=None) -> tuple[ChunkedStore, int]:
    """`head` read by bounded reading into a store, in the context `kvcli chat` gives cfg's policy and budget (the
    session resized to it, two sequences, and of the cache type kvcli chat reads `cache_type` in: float16 for
    q8_0 chunk files, store_types); `chunk` None: as chunking decides, else `default_chunk`. Returns (store,
    chunk length). Eval chat's bounded modes and stored mode. `kept` (a folder): the read saved there, or, where
    it exists, opened from there instead of read (checked: the same model, tokens and read settings), so that a
    second run over the same documents skips the reads (a 64k read takes 5-15 minutes on 2 cores)."""
    asked = cache_type or session.cache_type
    working, chunk_type = store_types(asked)
    chunking = plan_chunking(len(head), TURN_ROOM, session.n_ctx_train, cfg, chunk,
                             cell_bytes=session.info.cell_bytes(asked))
    step = chunking.chunk or chunk or default_chunk
    session.clear()
    session.use_cache_type(working)
    session.resize_context(chunking.n_ctx if chunking.chunk else pad_cells(cfg.budget + step + TURN_ROOM), 2)
    if kept is not None and Path(kept).exists():
        store = ChunkedStore.open(kept, session.model_path)
        split = max(1, len(head) - STORE_TAIL)
        if (store.tokens != list(head[:split]) or store.chunk != step or store.read_policy != cfg.policy
                or store.read_budget != cfg.budget or store.chunk_type != chunk_type):
            store.close()
            raise KvcliError(f"{kept}: a store of other tokens or settings (read {store.read_policy}@"
                             f"{store.read_budget}, chunk {store.chunk}); remove it to read again")
        return store, step
    store = ChunkedStore.read(session, head, cfg, step, cap=chunking.cap, chunk_type=chunk_type)
    if kept is not None:
        Path(kept).parent.mkdir(parents=True, exist_ok=True)
        store.save_as(kept, session)
    return store, step


def reselect_in_form(store: ChunkedStore, session, prompt: list[int], cfg, step: int, every_chunk: bool):
    """`prompt` re-selected from `store` through the block index's chosen chunks, or (`every_chunk`) through every
    stored chunk with a probe each in budget + one chunk: the form before the index."""
    store.select = 0 if every_chunk else None
    return store.reselect(session, prompt, cfg, cells=cfg.budget + step if every_chunk else None)


def stored_variants(session, head: list[int], question: list[int], cfgs, resolved: dict, unavailable: dict, *,
                    chunk: int | None):
    """Stored mode (the module's docstring): per configuration, `head` read once into a bounded store, then
    `head + question` re-selected from it in each of STORED_FORMS. Yields (policy, budget, form, status,
    first_logits, note, stats), seq 0 ready to decode from first_logits; the context is left as kvcli chat sized it
    for the last configuration."""
    prompt = list(head) + list(question)
    asked = session.cache_type
    for pol, bud in cfgs:
        why = unavailable.get(pol) or ("not run: the stored form re-selects a compressing policy's budget"
                                       if pol in ("full", TRUNCATE) else None)
        if why:
            for form in STORED_FORMS:
                yield pol, bud, form, why, None, "", {}
            continue
        cfg = resolved[(pol, bud)]
        try:
            cs, step = read_store_as_chat(session, head, cfg, chunk, cache_type=asked)
        except KvcliError as e:
            for form in STORED_FORMS:
                yield pol, bud, form, f"error: {e}", None, "", {}
            continue
        try:
            for form in STORED_FORMS:
                try:
                    r = reselect_in_form(cs, session, prompt, cfg, step, form == "every_chunk")
                except (KvcliError, ContextFull) as e:
                    yield pol, bud, form, f"error: {e}", None, "", {}
                    continue
                stats = {"read_s": round(cs.read_s, 3), "read_resumed_tokens": cs.resumed_tokens,
                         "store_bytes": cs.nbytes, "chunk": step,
                         "stored_chunks": r.stored, "reselect_chunks": r.chunks, "reselect_s": round(r.total_s, 4),
                         "index_s": round(r.index_s, 4), "n_ctx": session.n_ctx, **held(session)}
                yield pol, bud, form, "ok", session.logits(0), "", stats
                session.clear(0)
        finally:
            cs.close()


def _greedy(session, first_logits, max_tokens: int, sampler=None) -> str:
    """Decode sequence 0 from the prompt's last logits (greedy, or `sampler`'s penalties), stopping at end of
    generation."""
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    text, logits = "", first_logits
    pick = (sampler or Sampler()).start(session, max_tokens)
    try:
        for _ in range(max_tokens):
            tok = pick(logits)
            if session.is_eog(tok):
                break
            text += dec.decode(session.token_bytes(tok))
            try:
                session.step({0: tok})
            except ContextFull:
                break
            logits = session.logits(0)
    finally:
        pick.close()
    return text + dec.decode(b"", final=True)


def run_generation_eval(model_path, kind: str, tasks: list[str], policies: list[str], budgets: list[int],
                        lengths: list[int], depths: list[float], samples: int, *, cache_type: str = "f16",
                        policy_args: dict | None = None, threads: int | None = None, seed: int = 0, log=None,
                        chunk: int | None = None, chunk_scoring: str = "question", sampler=None,
                        agnostic: bool = False, stored: bool = False) -> dict:
    """kind "niah" (task niah over lengths x depths) or "ruler" (the RULER-style tasks over lengths).
    `agnostic`: compress the document before the question (the module's docstring), not with it in the prompt.
    `stored`: read the document into a bounded store and re-select it for the question (the module's docstring).

    Lengths beyond the model's context (or any `chunk`) are read in chunks of `chunk` tokens (default
    kvcli.drivers.chunked.DEFAULT_CHUNK), compressed after each, by every policy; `truncate` is their baseline."""
    log = log or (lambda m: None)
    policy_args = policy_args or {}
    for t in tasks:
        if t not in TASKS:
            raise KvcliError(f"unknown task '{t}': choose from {', '.join(RULER_TASKS)}")
    if samples < 1:
        raise KvcliError("--samples must be >= 1")
    unavailable, resolved = _check_policies(model_path, policies, budgets, policy_args)
    tok = _session(model_path, 0, cache_type, threads)  # tokenizer and templates only (no context)
    n_ctx_train = tok.n_ctx_train
    agnostic = agnostic or stored   # a store is read before its question is seen
    chunk_asked = chunk             # stored: None = the chunk kvcli chat would choose
    mode = "stored" if stored else "agnostic" if agnostic else "aware"
    long = bool(chunk) or stored or any(L + 64 > n_ctx_train for L in lengths)
    cfgs = eval_configs(policies, budgets, long)
    if stored and "full" not in policies:   # a reference the stored form cannot run: only when asked for
        cfgs = [c for c in cfgs if c[0] != "full"]
    if long:
        chunk = chunk or DEFAULT_CHUNK
        check_chunk(chunk)
        for b in budgets:   # and the 64 cells kept for the answer, as `long` keeps them above
            check_fits(b, chunk, 64, n_ctx_train, f"the model's context ({n_ctx_train} cells)")
    records, t_start, where = [], time.perf_counter(), machine(threads)
    interrupted = False
    try:
        for L in lengths:
            plan = []
            for task in tasks:
                for d in (depths if task in ("niah", "niah_single", "niah_multikey") else [None]):
                    for i in range(samples):
                        plan.append((task, d, i))
            built = []
            for task, d, i in plan:
                s = niah_sample(tok, L, d, i, seed) if task == "niah" else ruler_sample(tok, task, L, d, i, seed)
                built.append(s)
            splits = [agnostic_split(tok, s) if agnostic else (tok.tokenize(s.prompt), []) for s in built]
            if stored:   # stored_variants sizes the context per configuration, as kvcli chat does
                n_ctx = pad_cells(min(L, DEFAULT_CHUNK))
            else:
                n_ctx = n_ctx_train if long else max(len(a) + len(q) + s.max_tokens
                                                     for s, (a, q) in zip(built, splits)) + 16
            session = _session(model_path, n_ctx, cache_type, threads)
            try:
                for s, (toks, question) in zip(built, splits):
                    if stored:
                        variants = stored_variants(session, toks, question, cfgs, resolved, unavailable,
                                                   chunk=chunk_asked)
                    else:
                        variants = ((pol, bud, None, *rest) for pol, bud, *rest in
                                    sample_variants(session, toks, question, cfgs, resolved, unavailable,
                                                    reserve=s.max_tokens, chunk=chunk if long else None,
                                                    chunk_scoring=chunk_scoring))
                    n_before = len(records)
                    for pol, bud, form, status, first, note, stats in variants:
                        rec = {"task": s.task, "length": L, "tokens": s.n_tokens, "depth": s.depth, "sample": s.index,
                               "policy": pol, "budget": bud, "answers": s.answers, "status": status, "score": None,
                               "mode": mode, **({"form": form} if stored else {}),
                               **({"prefix_tokens": len(toks), "question_tokens": len(question)} if agnostic else {}),
                               **stats}
                        if status == "ok":
                            try:
                                pred = _greedy(session, first, s.max_tokens, sampler)
                                rec.update(prediction=pred, score=100 * string_match_all(pred, s.answers))
                            except KvcliError as e:
                                rec.update(status=f"error: {e}")
                        if note:
                            rec["note"] = note
                        records.append(rec)
                    log(f"{s.task} {L} tok depth={s.depth if s.depth is None else round(s.depth, 2)} #{s.index}: " +
                        ", ".join(f"{r['policy']}{'' if r['budget'] is None else '@' + str(r['budget'])}"
                                  f"{' ' + r['form'] if stored else ''}="
                                  f"{'-' if r['score'] is None else round(r['score'])}" for r in records[n_before:]))
            finally:
                session.close()
    except KeyboardInterrupt:   # Ctrl-C: the samples scored so far are the result (the command exits 130)
        interrupted = True
    finally:
        tok.close()
    by_form = ("form",) if stored else ()
    return {"kind": "eval", "task": kind, "model": str(model_path), "machine": where, "interrupted": interrupted,
            "settings": {"tasks": tasks, "policies": policies, "budgets": budgets, "lengths": lengths,
                         "depths": depths, "samples": samples, "cache_type": cache_type, "seed": seed,
                         "policy_args": policy_args, "metric": "RULER string_match_all, percent",
                         "chunk": chunk if long else None, "chunk_scoring": chunk_scoring if long else None,
                         "sampling": None if sampler is None else vars(sampler.sampling),
                         "mode": mode, **({"forms": list(STORED_FORMS)} if stored else {}),
                         "layout": AGNOSTIC_LAYOUT if agnostic else
                         "question-aware: the document and the question in one user turn, compressed together"},
            "elapsed_s": time.perf_counter() - t_start, "records": records,
            "cells": aggregate(records, ("task", "policy", "budget", "length", "depth") + by_form),
            "summary": aggregate(records, ("task", "policy", "budget", "length") + by_form)}


def aggregate(records: list[dict], keys: tuple[str, ...], metric: str = "score", higher_better: bool = True) -> list:
    """Mean `metric` per group, and the same as a fraction of the full cache on the same samples."""
    groups: dict[tuple, list] = {}
    for r in records:
        groups.setdefault(tuple(r[k] for k in keys), []).append(r)
    full = {}
    for r in records:
        if r["policy"] == "full" and r.get(metric) is not None:
            full[(r["task"], r["length"], r.get("depth"), r.get("sample"), r.get("doc"))] = r[metric]
    out = []
    for k, rs in groups.items():
        item = dict(zip(keys, k))
        bad = [r for r in rs if r.get(metric) is None]
        if bad:
            item.update({metric: None, "status": bad[0]["status"], "n": len(rs)})
            out.append(item)
            continue
        item[metric] = float(np.mean([r[metric] for r in rs]))
        item["n"] = len(rs)
        same = [full.get((r["task"], r["length"], r.get("depth"), r.get("sample"), r.get("doc"))) for r in rs]
        if all(v is not None for v in same):
            base = float(np.mean(same))
            item[f"full_{metric}"] = base
            if higher_better:
                item["frac_of_full"] = item[metric] / base if base > 0 else None
            else:
                item["ratio_to_full"] = item[metric] / base if base > 0 else None
        for extra in ("kl_mean", "kv_cells", "kv_bytes", "kv_bytes_live", "peak_kv_cells", "prefill_s", "compress_s",
                      "reconstruct_s"):
            vals = [r[extra] for r in rs if r.get(extra) is not None]
            if vals:
                item[extra] = float(np.mean(vals))
        item["status"] = "ok"
        out.append(item)
    return out


def summary_table(result: dict) -> str:
    """Score (or perplexity) per policy x budget x length, and relative to the full cache."""
    fid = result["task"] == "fidelity"
    metric = "ppl" if fid else "score"
    rows = result["summary"]
    lengths = sorted({r["length"] for r in rows})
    tasks = sorted({r["task"] for r in rows})
    lines = []
    for task in tasks:
        lines.append(f"{task}: "
                     f"{'perplexity (ratio to full) [mean KL to full]' if fid else 'score % (fraction of full)'}")
        head = f"{'policy':<22}" + "".join(f"{L:>24}" for L in lengths)
        lines += [head, "-" * len(head)]
        keys = []   # (policy, budget, form): a stored evaluation's forms get rows of their own
        for r in rows:
            if r["task"] == task and (r["policy"], r["budget"], r.get("form")) not in keys:
                keys.append((r["policy"], r["budget"], r.get("form")))
        for pol, bud, form in keys:
            cells = []
            for L in lengths:
                m = [r for r in rows if (r["task"], r["policy"], r["budget"], r["length"], r.get("form")) ==
                     (task, pol, bud, L, form)]
                if not m:
                    cells.append("")
                    continue
                r = m[0]
                if r.get(metric) is None:
                    cells.append(str(r.get("status", "-"))[:22])
                elif fid:
                    ratio = r.get("ratio_to_full")
                    kls = r.get("kl_mean")
                    cells.append(f"{r['ppl']:.2f} ({'-' if ratio is None else f'{ratio:.3f}'})"
                                 f" [{'-' if kls is None else f'{kls:.3f}'}]")
                else:
                    fr = r.get("frac_of_full")
                    cells.append(f"{r['score']:.0f} ({'n/a' if fr is None else f'{fr:.2f}'})")
            name = (pol if bud is None else f"{pol}@{bud}") + (f" {form}" if form else "")
            lines.append(f"{name:<22}" + "".join(f"{c:>24}" for c in cells))
        lines.append("")
    if not fid:
        lines.append("fraction of full = policy score / full-cache score on the same samples; n/a where the full "
                     "cache scores 0")
    return "\n".join(lines).rstrip()
