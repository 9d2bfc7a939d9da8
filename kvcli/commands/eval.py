"""kvcli eval niah|ruler|fidelity: quality of compressed caches on locally generated tasks and real text."""
from __future__ import annotations

import json
from pathlib import Path

import click

from kvcli.drivers.bench import _jsonable, load_docs, log_stderr
from kvcli.commands.options import Request, json_option, model_option, request_options
from kvcli.errors import KvcliError
from kvcli.evaluation.chat import DEFAULT_MODES as CHAT_MODES, chat_table, plot_chat, run_chat_eval
from kvcli.evaluation.corpus import corpus_documents
from kvcli.evaluation.fidelity import fidelity_table, run_fidelity
from kvcli.evaluation.fidelity_reselect import DEFAULT_DEPTHS, PROBES, run_fidelity_reselect
from kvcli.evaluation.measure import parse_float_list, parse_list, parse_size
from kvcli.evaluation.questions import KINDS as QUESTION_KINDS
from kvcli.evaluation.report import check_png, plot_niah, plot_scores, write_text
from kvcli.evaluation.runner import run_generation_eval, summary_table
from kvcli.evaluation.tasks import RULER_TASKS
from kvcli.models import resolve_model
from kvcli.templating import GENERIC_SUFFIX

AGNOSTIC_HELP = ("Compress each document before its question is seen (question-agnostic, as kvcli chat "
                 "--compress-once): the prompt is split where the question begins; the chat template's head, the "
                 f"document and kvcli's generic instruction (\"{GENERIC_SUFFIX}\") are prefilled once and "
                 "compressed by every configuration, then the question follows as "
                 "the next user turn (with the answer prefix) and is answered greedily from the compressed cache. "
                 "Default: question-aware (the document and the question in one user turn, compressed together).")
STORED_HELP = ("Answer as kvcli chat answers over a book: each document (the --agnostic layout) is read once per "
               "policy and budget by bounded reading into a store of every chunk, then the question is re-selected "
               "from it twice, through the block index's chosen chunks (form 'index', kvcli chat today) and through "
               "every stored chunk with a probe each (form 'every_chunk'); results per form. 'full' is not run.")
CHUNK_HELP = ("Read every prompt in chunks of N tokens, compressing after each (kvcli/drivers/chunked.py); on by "
              "itself "
              "(1024) for lengths beyond the model's context. Add 'truncate' to --policies for the plain-truncation "
              "baseline: the first 32 tokens and the last budget - 32 (and, read in chunks, the context's worth).")

LABELS_HELP = ("Comma-separated policies; a policy may carry its own arguments as POLICY:KEY=VALUE[:KEY=VALUE] "
               "(e.g. snapkv:window=16,snapkv:window=64: one policy with two settings side by side, on one "
               "prefill), which override --policy-arg's for that label.")


FIDELITY_CHUNK_HELP = ("Read a prefix past the context (--max-context) in chunks of N tokens, compressing after each "
                       "(kvcli/drivers/chunked.py). Default: 1024.")


def shared_options(default_lengths: str, chunked: bool | str = True, labels: bool = False,
                   chunk_help: str = CHUNK_HELP):
    """The options of every eval command; chunked adds --chunk and --chunk-scoring (and the penalties: True; without
    them: "chunk", for a command that decodes nothing of its own); labels: --policies takes
    POLICY:KEY=VALUE labels (kvcli/evaluation/corpus_eval.py's split_variant)."""
    def deco(f):
        for opt in reversed([
            model_option,
            request_options("policies", "cache_type", "threads",
                            *({True: ["chunk", "penalties"], "chunk": ["chunk"]}.get(chunked, [])),
                            cache_types=("f16", "q8_0", "q4_0"), cache_type_help=None, chunk_help=chunk_help,
                            **({"policies_help": LABELS_HELP} if labels else {})),
            click.option("--lengths", default=default_lengths, show_default=True,
                         help="Comma-separated prompt lengths in tokens (1k = 1024)."),
            click.option("--plot", "plot_path", default=None, metavar="FILE.png", help="Write a PNG plot."),
            click.option("--json-out", "json_path", default=None, metavar="FILE",
                         help="Also write the result as JSON."),
            click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr."),
            json_option,
        ]):
            f = opt(f)
        return f
    return deco


def _prepare(model, lengths, plot_path):
    lens = parse_list(lengths, "--lengths", lambda s: parse_size(s, "--lengths"))
    check_png(plot_path)
    return resolve_model(model), lens


def _finish(result, as_json, json_path, plot_path, quiet, plot):
    """Print and write the result; an interrupted evaluation writes what it scored, then exits 130."""
    if result.get("interrupted") and not result["records"]:
        raise KeyboardInterrupt
    if result.get("interrupted"):
        log_stderr(f"interrupted: {len(result['records'])} results of the samples read so far are kept")
    if as_json:
        click.echo(json.dumps(result, default=_jsonable))
    else:
        click.echo(summary_table(result))
    if json_path:
        write_text(json_path, json.dumps(result, indent=1, default=_jsonable))
    if plot_path:
        plot(result, plot_path)
        if not quiet:
            log_stderr(f"plot written to {plot_path}")
    if result.get("interrupted"):
        raise KeyboardInterrupt


@click.group("eval")
def eval_group():
    """Quality of compressed caches: needle in a haystack, RULER-style tasks, fidelity on real text.
    Every score is also given as a fraction of the full cache's score on the same samples."""


@eval_group.command("niah")
@shared_options("1k,2k")
@click.option("--depths", default="0.1,0.3,0.5,0.7,0.9", show_default=True,
              help="Needle depths (fractions of the document).")
@click.option("--samples", type=click.IntRange(1, 1000), default=1, show_default=True,
              help="Samples per length and depth.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--agnostic", is_flag=True, help=AGNOSTIC_HELP)
@click.option("--stored", is_flag=True, help=STORED_HELP)
def niah_cmd(req: Request, model, lengths, plot_path, json_path, quiet, as_json, depths, samples, seed, agnostic,
             stored):
    """Needle in a haystack over lengths x depths (logbook haystack of kvcli/evaluation/logbook.py)."""
    path, lens = _prepare(model, lengths, plot_path)
    ds = parse_float_list(depths, "--depths")
    result = run_generation_eval(path, "niah", ["niah"], req.policies, req.budgets, lens, ds, samples,
                                 cache_type=req.cache_type, policy_args=req.scoped_args, threads=req.threads,
                                 seed=seed, log=None if quiet else log_stderr, chunk=req.chunk,
                                 chunk_scoring=req.chunk_scoring, sampler=req.sampler(), agnostic=agnostic,
                                 stored=stored)
    _finish(result, as_json, json_path, plot_path, quiet, plot_niah)


@eval_group.command("ruler")
@shared_options("1k,2k")
@click.option("--tasks", default="niah_single,niah_multikey,vt,cwe", show_default=True,
              help="Comma-separated RULER-style tasks.")
@click.option("--depths", default="0.25,0.75", show_default=True, help="Needle depths for the niah_* tasks.")
@click.option("--samples", type=click.IntRange(1, 1000), default=2, show_default=True,
              help="Samples per task, length (and depth).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--agnostic", is_flag=True, help=AGNOSTIC_HELP)
@click.option("--stored", is_flag=True, help=STORED_HELP)
def ruler_cmd(req: Request, model, lengths, plot_path, json_path, quiet, as_json, tasks, depths, samples, seed,
              agnostic, stored):
    """RULER-style synthetic tasks with RULER's string-match metric."""
    path, lens = _prepare(model, lengths, plot_path)
    ts = parse_list(tasks, "--tasks", lambda s: s.lower())
    for t in ts:
        if t not in RULER_TASKS:
            raise KvcliError(f"--tasks: unknown task '{t}' (choose from {', '.join(RULER_TASKS)})")
    ds = parse_float_list(depths, "--depths")
    result = run_generation_eval(path, "ruler", ts, req.policies, req.budgets, lens, ds, samples,
                                 cache_type=req.cache_type, policy_args=req.scoped_args, threads=req.threads,
                                 seed=seed, log=None if quiet else log_stderr, chunk=req.chunk,
                                 chunk_scoring=req.chunk_scoring, sampler=req.sampler(), agnostic=agnostic,
                                 stored=stored)
    _finish(result, as_json, json_path, plot_path, quiet, plot_scores)


@eval_group.command("fidelity")
@shared_options("1k,2k", chunked="chunk", labels=True, chunk_help=FIDELITY_CHUNK_HELP)
@click.option("--docs", "--doc", "docs", default=None, metavar="FILES|DIR",
              help="Real text: comma-separated files or a directory. Default: the repository's examples/ texts "
              "(or, with --corpus, the corpus's documents).")
@click.option("--corpus", "corpus_dir", default=None, metavar="DIR",
              help="A corpus built by `kvcli eval corpus build`: its documents, filtered by --split, --genres and "
              "--max-doc-tokens (their files checked against the manifest's sha256).")
@click.option("--split", type=click.Choice(["tune", "heldout", "all"]), default="tune", show_default=True,
              help="With --corpus: the tuning part, the held-out part or both.")
@click.option("--genres", default=None, help="With --corpus: comma-separated genres (technical, legal, narrative, "
              "reference). Default: all.")
@click.option("--max-doc-tokens", type=click.IntRange(1), default=None,
              help="With --corpus: only documents of at most this many tokens (the manifest's count).")
@click.option("--cont", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="Continuation tokens scored after each prefix.")
@click.option("--form", type=click.Choice(["once", "reselect", "aware"]), default="once", show_default=True,
              help="once: compressed once, question-agnostic (kvcli compress), scored on the document's next tokens. "
              "reselect: re-selected for each probe as kvcli chat re-selects (the exact form), scored on the probe's "
              "continuation (kvcli/evaluation/fidelity_reselect.py). aware: the same probes, each compressed once "
              "with its whole prompt (question-aware, as kvcli run --question), scored on the same continuation.")
@click.option("--probes", default=None, help="With --form reselect or aware: comma-separated probes: quote (a "
              "lead-in of the document at each --depths quoted, the document's text after it scored), summary (the "
              "corpus's summary question, the full cache's greedy answer scored). Default: quote,summary.")
@click.option("--depths", default=None, help="With --form reselect or aware: where the quote probes' lead-ins "
              "start, as fractions of the document. Default: 0.25,0.5,0.75.")
@click.option("--max-context", type=click.IntRange(64), default=None, metavar="N",
              help="With --form once: the most tokens a full cache may hold (default: the model's context). A prefix "
              "and continuation longer than that is past the context: the reference is the full cache of its first "
              "32 and last N - --cont - 48 tokens, and the compressed caches read the whole prefix in chunks.")
def fidelity_cmd(req: Request, model, lengths, plot_path, json_path, quiet, as_json, docs, corpus_dir, split, genres,
                 max_doc_tokens, cont, form, probes, depths, max_context):
    """KL divergence and top-1 agreement of a compressed cache against the full cache on a document's
    teacher-forced continuation, and its perplexity (no question needed). --lengths all: each document's whole
    text but its last --cont tokens is the prefix (--form reselect or aware: the whole document)."""
    whole = lengths.strip().lower() == "all"
    if form == "once" and (probes is not None or depths is not None):
        raise KvcliError("--probes and --depths are for --form reselect or aware")
    if form != "once" and (max_context is not None or req.chunk is not None):
        raise KvcliError("--max-context and --chunk are for --form once (a probe's full cache must fit the context)")
    path, lens = _prepare(model, "1" if whole else lengths, plot_path)
    if corpus_dir:
        documents, meta = corpus_documents(corpus_dir, split, genres, max_doc_tokens, docs)
    elif genres or max_doc_tokens:
        raise KvcliError("--genres and --max-doc-tokens select corpus documents: give --corpus DIR")
    else:
        ex = Path(__file__).resolve().parents[2] / "examples"
        if docs is None and not ex.is_dir():
            raise KvcliError("no --docs given and no examples/ folder next to kvcli: pass --docs FILES|DIR")
        documents, meta = load_docs([ex] if docs is None else [p for p in docs.split(",") if p.strip()]), {}
    common = dict(cache_type=req.cache_type, policy_args=req.scoped_args, threads=req.threads,
                  log=None if quiet else log_stderr, doc_meta=meta)
    if form != "once":
        result = run_fidelity_reselect(
            path, documents, req.policies, req.budgets, None if whole else lens, cont,
            probes=parse_list(probes or ",".join(PROBES), "--probes", lambda s: s.lower()),
            depths=parse_float_list(depths, "--depths") if depths is not None else DEFAULT_DEPTHS, form=form, **common)
    else:
        result = run_fidelity(path, documents, req.policies, req.budgets, None if whole else lens, cont,
                              chunk=req.chunk, chunk_scoring=req.chunk_scoring, max_context=max_context, **common)
    if result.get("interrupted") and not result["records"]:
        raise KeyboardInterrupt
    click.echo(json.dumps(result, default=_jsonable) if as_json else fidelity_table(result))
    if json_path:
        write_text(json_path, json.dumps(result, indent=1, default=_jsonable))
    if plot_path:
        plot_scores(result, plot_path, metric="kl_mean", ylabel="KL to the full cache (nats)")
    if result.get("interrupted"):
        raise KeyboardInterrupt


@eval_group.command("chat")
@shared_options("4k", chunked=False)
@click.option("--documents", type=click.IntRange(1, 1000), default=2, show_default=True,
              help="Documents per length (each a logbook with --facts planted facts).")
@click.option("--facts", type=click.IntRange(1, 20), default=6, show_default=True,
              help="Facts planted per document at spread depths; one question each, asked in one conversation.")
@click.option("--modes", default=",".join(CHAT_MODES), show_default=True,
              help="full: full cache; once: compressed before the questions (question-agnostic); alone: the "
              "once cache, each question asked alone after it; context: compressed from the document alone and each "
              "question asked alone in its turn (kvpress's pipeline layout; the full cache on it too); reselect: "
              "re-selected for every question from the stored full cache (kvcli chat's default); run: each question "
              "compressed alone, question-aware, from the stored cache (kvcli run --question ...); reread: the same "
              "with the document read again for every question (slow); bounded: reselect in the bounded form (the "
              "document stored chunk by chunk as bounded reading reads it, per configuration, and each question "
              "streaming the chunks the block index chooses, as kvcli chat does; window policies); bounded_all: the "
              "same read, every chunk streamed with a probe each (the bounded form before the index). The bounded "
              "modes alone read lengths past the model's context.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--from-document", "first", type=click.IntRange(0, 999), default=0, show_default=True,
              help="Start at this document (0-based) of the seed's series: documents FROM .. FROM+N-1 are those a run "
              "with more --documents reads there, so one evaluation can be split over processes or machines and "
              "pooled (benchmarks/eval_chat_tables.py).")
def chat_cmd(req: Request, model, lengths, plot_path, json_path, quiet, as_json, documents, facts, modes, seed, first):
    """Many questions over one document, asked in one conversation, scored per question (SCBench's multi-turn
    mode), for each way of compressing: full, once, reselect and run."""
    path, lens = _prepare(model, lengths, plot_path)
    ms = parse_list(modes, "--modes", lambda s: s.lower())
    result = run_chat_eval(path, req.policies, req.budgets, lens, documents, facts, ms, cache_type=req.cache_type,
                           policy_args=req.scoped_args, threads=req.threads, seed=seed,
                           first_document=first, log=None if quiet else log_stderr)
    if result.get("interrupted") and not result["records"]:
        raise KeyboardInterrupt
    click.echo(json.dumps(result, default=_jsonable) if as_json else chat_table(result))
    if json_path:
        write_text(json_path, json.dumps(result, indent=1, default=_jsonable))
    if plot_path:
        plot_chat(result, plot_path)
    if result.get("interrupted"):
        raise KeyboardInterrupt


@eval_group.group("corpus")
def corpus_group():
    """The real-text corpus (issue #63): documents that installed Debian packages ship, and questions made from
    their own text. See docs/results/real-text.md."""


@corpus_group.command("build")
@model_option
@click.option("--out", "out_dir", required=True, metavar="DIR", help="Folder to write the documents and manifest.json.")
@click.option("--only", default=None, help="Comma-separated document ids or genres (default: every document).")
@click.option("--no-tokens", is_flag=True, help="Leave token counts out (no model is loaded).")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
def corpus_build_cmd(model, out_dir, only, no_tokens, quiet):
    """Assemble the corpus from installed packages into DIR, with a manifest (package, version, licence, genre,
    tokens of --model's tokenizer, sha256, tuning or held-out part). Stops, naming the packages and the
    apt-get command, when a source is missing."""
    from kvcli.evaluation.corpus import build_corpus
    from kvcli.engines import open_native
    count, name, tok = None, None, None
    if not no_tokens:
        path = resolve_model(model)
        tok = open_native(path, n_ctx=0)
        count, name = (lambda text: len(tok.tokenize(text))), Path(path).name
    try:
        m = build_corpus(out_dir, count, name, only=parse_list(only, "--only") if only else None,
                         log=None if quiet else log_stderr)
    finally:
        if tok is not None:
            tok.close()
    click.echo(corpus_summary(m))


@corpus_group.command("questions")
@click.option("--corpus", "corpus_dir", required=True, metavar="DIR",
              help="A corpus built by `kvcli eval corpus build`.")
@click.option("--split", type=click.Choice(["tune", "heldout", "all"]), default="tune", show_default=True)
@click.option("--per-kind", type=click.IntRange(1, 50), default=2, show_default=True,
              help="Questions of each kind per document (one summary question).")
@click.option("--out", "out_path", default=None, metavar="FILE.jsonl", help="Write the questions, one JSON a line.")
def corpus_questions_cmd(corpus_dir, split, per_kind, out_path):
    """Make the questions of the corpus's documents from their own text (kvcli/evaluation/questions.py) and print
    how many of each kind; --out writes them."""
    from kvcli.evaluation.corpus import load_manifest, select, verify
    from kvcli.evaluation.questions import KINDS, make_questions
    manifest = load_manifest(corpus_dir)
    docs = select(manifest, split)
    verify(corpus_dir, docs)
    qs = []
    for d in docs:
        text = (Path(corpus_dir) / d["file"]).read_text(encoding="utf-8")
        qs += [dict(q.as_dict(), genre=d["genre"], split=d["split"]) for q in make_questions(d["id"], text,
                                                                                            d["format"], per_kind)]
    if out_path:
        write_text(out_path, "".join(json.dumps(q) + "\n" for q in qs))
    counts = {k: sum(q["kind"] == k for q in qs) for k in KINDS}
    click.echo(f"{len(qs)} questions on {len(docs)} documents ({split}): "
               + ", ".join(f"{k} {n}" for k, n in counts.items()))


@corpus_group.command("ask")
@shared_options("1", chunked=False, labels=True)
@click.option("--corpus", "corpus_dir", required=True, metavar="DIR",
              help="A corpus built by `kvcli eval corpus build`.")
@click.option("--split", type=click.Choice(["tune", "heldout", "all"]), default="tune", show_default=True)
@click.option("--docs", "docs", default=None, help="Comma-separated document ids (default: every one of the part).")
@click.option("--genres", default=None, help="Comma-separated genres. Default: all.")
@click.option("--max-doc-tokens", type=click.IntRange(1), default=None,
              help="Only documents of at most this many tokens (the manifest's count).")
@click.option("--min-doc-tokens", type=click.IntRange(1), default=None,
              help="Only documents of at least this many tokens (the manifest's count).")
@click.option("--per-kind", type=click.IntRange(1, 50), default=2, show_default=True,
              help="Questions of each kind per document (one summary question).")
@click.option("--kinds", default=",".join(QUESTION_KINDS), show_default=True, help="Comma-separated question kinds.")
@click.option("--mode", type=click.Choice(["once", "reselect", "bounded"]), default="once", show_default=True,
              help="once: compressed once before the questions (question-agnostic), each question alone after it. "
              "reselect: kvcli chat's exact form: the document's full cache read once and stored, each question "
              "re-selected from it with the question known; the full cache of the same prompt is the reference. "
              "bounded: kvcli chat's bounded form: per configuration the document read once in chunks into a store, "
              "each question re-selected from it in each of --forms (window policies; any length). "
              "(kvcli/evaluation/corpus_reselect.py)")
@click.option("--forms", default=None, help="With --mode bounded: comma-separated forms: index (the block index's "
              "chosen chunks, kvcli chat's default), all (every chunk streamed, as KVCLI_RESELECT_CHUNKS=all: the "
              "reference), every_chunk (every chunk with a probe each). Default: index,all.")
@click.option("--stores", "stores", default=None, metavar="DIR", help="With --mode bounded: keep each document's "
              "read in DIR (DOC-POLICY-BUDGET, a chunk store) and reuse it when it is there: a second run skips the "
              "reads.")
def corpus_ask_cmd(req: Request, model, lengths, plot_path, json_path, quiet, as_json, corpus_dir, split, docs, genres,
                   max_doc_tokens, min_doc_tokens, per_kind, kinds, mode, forms, stores):
    """Ask the corpus's questions of each compressed cache, scored automatically against the document's text, and
    each configuration's answers against its reference's (the full cache; in the bounded form, every chunk
    streamed). --mode once (default): compressed once before the questions (question-agnostic), each question alone
    after it; reselect / bounded: re-selected for each question as kvcli chat answers it.
    (--lengths and --plot are not used.)"""
    from kvcli.evaluation.corpus import load_manifest
    from kvcli.evaluation.corpus_eval import questions_table, run_corpus_questions
    from kvcli.evaluation.corpus_reselect import DEFAULT_FORMS, run_corpus_chat
    ks = parse_list(kinds, "--kinds", lambda s: s.lower())
    for k in ks:
        if k not in QUESTION_KINDS:
            raise KvcliError(f"--kinds: unknown kind '{k}' (choose from {', '.join(QUESTION_KINDS)})")
    if forms is not None and mode != "bounded":
        raise KvcliError("--forms is for --mode bounded")
    if stores is not None and mode != "bounded":
        raise KvcliError("--stores is for --mode bounded")
    if min_doc_tokens and max_doc_tokens and min_doc_tokens > max_doc_tokens:
        raise KvcliError(f"--min-doc-tokens {min_doc_tokens} is more than --max-doc-tokens {max_doc_tokens}")
    fs = parse_list(forms, "--forms", lambda s: s.lower()) if forms is not None else list(DEFAULT_FORMS)
    documents, meta = corpus_documents(corpus_dir, split, genres, max_doc_tokens, docs, min_tokens=min_doc_tokens)
    formats = {d["id"]: d["format"] for d in load_manifest(corpus_dir)["documents"]}
    common = dict(per_kind=per_kind, kinds=ks, cache_type=req.cache_type, policy_args=req.scoped_args,
                  threads=req.threads, doc_meta=meta, formats=formats, log=None if quiet else log_stderr)
    if mode == "once":
        result = run_corpus_questions(resolve_model(model), documents, req.policies, req.budgets, **common)
    else:
        result = run_corpus_chat(resolve_model(model), documents, req.policies, req.budgets, mode=mode, forms=fs,
                                 stores=stores, **common)
    if result.get("interrupted") and not result["records"]:
        raise KeyboardInterrupt
    click.echo(json.dumps(result, default=_jsonable) if as_json else questions_table(result))
    if json_path:
        write_text(json_path, json.dumps(result, indent=1, default=_jsonable))
    if result.get("interrupted"):
        raise KeyboardInterrupt


def corpus_summary(manifest: dict) -> str:
    """Documents per genre and split, and per length bucket where tokens were counted."""
    from kvcli.evaluation.corpus import GENRES, length_bucket
    docs = manifest["documents"]
    lines = [f"{len(docs)} documents" + (f", tokens of {manifest['tokenizer']}" if manifest.get("tokenizer") else "")]
    for g in GENRES:
        ds = [d for d in docs if d["genre"] == g]
        if not ds:
            continue
        line = f"  {g:<10} {len(ds):>3} ({sum(d['split'] == 'heldout' for d in ds)} held out)"
        if all("tokens" in d for d in ds):
            toks = sorted(d["tokens"] for d in ds)
            line += f"  tokens {toks[0]:,}-{toks[-1]:,}"
        lines.append(line)
    if docs and all("tokens" in d for d in docs):
        buckets: dict[str, int] = {}
        for d in docs:
            buckets[length_bucket(d["tokens"])] = buckets.get(length_bucket(d["tokens"]), 0) + 1
        lines.append("  lengths: " + ", ".join(f"{k} {v}" for k, v in buckets.items()))
    return "\n".join(lines)


COMMANDS = [eval_group]
