"""kvcli chat: compress a document once, then a multi-turn conversation on the compressed cache."""
from __future__ import annotations

import sys
from pathlib import Path

import click
from click.core import ParameterSource

from kvcli import config, kvc, policies
from kvcli.apps.chat import Conversation, store_model
from kvcli.apps.chat_repl import Repl
from kvcli.commands.options import Request, model_option, request_options
from kvcli.documents import open_documents
from kvcli.errors import KvcliError
from kvcli.models import resolve_model
from kvcli.engines import open_native
from kvcli.drivers.reselect_bounded import check_store_target, is_store
from kvcli.apps.run_document import Progress, progress_bar


def explicit(ctx: click.Context, *names: str) -> list[str]:
    """The options among `names` that were given on the command line (not from a default)."""
    return [n for n in names if ctx.get_parameter_source(n) == ParameterSource.COMMANDLINE]


# what a --cache file fixes, with the flag that would contradict it
FLAGS = {"docs": "--doc", "policy": "--policy", "budget": "--budget", "policy_args": "--policy-arg",
         "system": "--system", "cache_type": "--cache-type", "chunk": "--chunk", "max_cache": "--max-cache",
         "chunk_scoring": "--chunk-scoring"}


def progress_factory(enabled: bool, desc: str = "prefill"):
    return lambda total: progress_bar(total, enabled, desc)


def open_conversation(*, docs, cache_path, model, req: Request, system, question, show_progress: bool, quiet: bool,
                      reselect: bool = False, store: str | None = None):
    """A Conversation from --doc (prefilled and compressed now, or read and stored for re-selection, with a summary
    on stderr) or --cache (a compressed file, or with `reselect` a stored full cache)."""
    if cache_path and reselect:
        # checked once, for the model the store is opened with, before the store is read, and passed down
        compression = req.compression(store_model(cache_path, model))
        conv = Conversation.from_store(cache_path, compression=compression, n_threads=req.threads)
    elif cache_path:
        conv = Conversation.from_kvc(cache_path, model=model, n_threads=req.threads)
    else:
        document = open_documents(list(docs))
        path = resolve_model(model or config.get("model"))
        compression = req.compression(path, question)   # checked once, before the model loads, and passed down
        if store:
            check_store_target(store)   # a file or a store folder: which one is known once the document is tokenized
        session = open_native(path, n_ctx=0, cache_type=req.cache_type, n_threads=req.threads)
        conv = Conversation(session, document.text, compression=compression, system=system,
                            question=None if reselect else question, chunk=req.chunk, max_cache=req.max_cache,
                            chunk_scoring=req.chunk_scoring, reselect=reselect,
                            store_path=Path(store).expanduser() if store else None)
        conv.source = document   # its pages and sections, for the citations (kvcli/citations.py)
        progress = Progress(len(conv.prefix_tokens), show_progress)
        try:
            conv.compress(progress=progress, on_cache=progress.cache)
        finally:
            progress.close()
    if not quiet:
        click.echo(conv.summary_line(), err=True)
    return conv


@click.command("chat")
@click.argument("question", required=False)
@click.option("--doc", "docs", multiple=True, metavar="FILE",
              help="Document(s) to talk about (several are joined with their names).")
@click.option("--cache", "cache_path", metavar="FILE.kvc|DIR", type=click.Path(),
              help="Instead of --doc: a compressed document (kvcli compress, /save), or a stored document "
              "(kvcli compress --store, --store PATH, /save of a re-selected chat), re-selected per question with "
              "--policy P --budget N: a .kvc file of its full cache, or a store folder (store.json + chunk files) "
              "of a document stored in bounded chunks.")
@model_option
@request_options("policy", "sampling", "cache_type", "chunking", "threads", max_tokens=512,
                 cache_type_help="llama.cpp KV cache type (a --cache file brings its own).")
@click.option("--question", "question_opt", metavar="TEXT",
              help="Compress for this question (question-aware); the same as giving QUESTION.")
@click.option("--system", default=config.default("system"), help="System message (before the document).")
@click.option("--compress-once", is_flag=True, help="Compress the document once, before the questions (question-"
              "agnostic, or for QUESTION), and answer every question from that cache, instead of re-selecting the "
              "cache for every question from the stored full cache (the default with a compressing policy).")
@click.option("--store", "store", metavar="PATH", default=None,
              help="Re-selection: keep the stored document at PATH (reused later with --cache PATH --policy P "
              "--budget N) instead of a temporary one in kvcli's cache folder, deleted at exit: a .kvc file of its "
              "full cache (the exact form), or, for a document re-selected in bounded chunks (longer than the "
              "context, above 256 MiB of full cache, --chunk N, --max-cache), a store folder: store.json (model, "
              "tokens, turns, each chunk's SHA-256) and one file per chunk. An existing store is replaced.")
@click.option("--fresh", is_flag=True, help="Answer every question from the compressed document alone "
              "(/reset before each one) instead of keeping the conversation.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar, summary or per-answer stats on stderr.")
@click.option("--cite", is_flag=True, help="Under every answer, name the passages of the document it came from (page "
              "or section, lines, a quote), ranked by the attention the answer's tokens gave the kept entries. --json "
              "always carries them (\"citations\").")
@click.option("--json", "as_json", is_flag=True, help="With stdin piped: one JSON object per answer, one per line.")
@click.pass_context
def chat_cmd(ctx, req: Request, question, docs, cache_path, model, question_opt, system, compress_once, store,
             fresh, quiet, cite, as_json):
    """Chat about a document whose KV cache is compressed by --policy to --budget.

    Re-selected (the default with a compressing policy): the document is read once and its full cache
    stored in a file; every question is answered from a cache compressed for that question (restore,
    prefill the question with observation, plan, compact), so later questions find what they need.
    --compress-once compresses the document once before the questions instead: QUESTION (or
    --question) is placed after the document before compressing (question-aware); without one the
    document is compressed with a generic instruction (question-agnostic). The summary line says which.

    On a terminal: a REPL with line editing and history (/help lists the commands; Ctrl-C
    interrupts an answer, Ctrl-D leaves). With standard input piped: one question per line, one
    answer block per question on stdout (blank line between blocks), so it scripts. Re-selected, a
    QUESTION on the command line is simply asked first.
    """
    if question and question_opt and question.strip() != question_opt.strip():
        raise KvcliError("give the question either as QUESTION or as --question, not two different ones")
    question = (question or question_opt or "").strip() or None
    # a question-agnostic policy (PolicySpec.agnostic) is compressed once: re-selecting it per question would
    # score the same
    reselect = not compress_once and req.policy != "full" and not policies.get(req.policy).agnostic
    if store and not reselect:
        raise KvcliError("--store keeps the full cache of re-selection: drop it, or --compress-once, or choose a "
                         "compressing policy")
    if cache_path and explicit(ctx, "policy", "budget") and not compress_once:
        reselect = True   # a stored full cache, re-selected with the policy given
        clash = [c for c in explicit(ctx, *FLAGS) if c not in ("policy", "budget", "policy_args")]
        if clash:
            raise KvcliError(f"--cache brings its own document: drop {FLAGS[clash[0]]}")
        if req.policy == "full":   # a compressing policy without --budget: resolve's one message, below
            raise KvcliError("re-selecting from --cache needs a compressing --policy and --budget N")
        if store:
            raise KvcliError("--cache brings its own stored document: drop --store")
    elif cache_path:
        reselect = False
        clash = explicit(ctx, *FLAGS)
        if clash:
            raise KvcliError(f"--cache brings its own document and compression: drop {FLAGS[clash[0]]}")
        meta = kvc.peek_meta(cache_path)
        if is_store(cache_path):
            raise KvcliError(f"{cache_path} is a bounded store folder (a document stored in chunks): give --policy P "
                             "--budget N to compress it for every question")
        if meta and meta.get("store") and not meta.get("compressed"):
            raise KvcliError(f"{cache_path} holds a document's full cache (compress --store): give --policy P "
                             "--budget N to compress it for every question")
    elif not docs:
        raise KvcliError("kvcli chat needs a document: --doc FILE, or --cache FILE.kvc")
    elif "-" in docs:
        raise KvcliError("kvcli chat reads questions from standard input: pass the document as a file (--doc FILE)")
    interactive = sys.stdin.isatty()
    if as_json and interactive:
        raise KvcliError("--json is for piped use (stdin not a terminal): one JSON object per answer")
    conv = open_conversation(docs=docs, cache_path=cache_path, model=model, req=req, system=system,
                             question=question, show_progress=not quiet and sys.stderr.isatty(), quiet=quiet,
                             reselect=reselect, store=store)
    try:
        if cache_path and conv.pending and not question and not quiet:
            click.echo(f"[compressed for the question: {conv.question}]", err=True)
        repl = Repl(conv, max_tokens=req.max_tokens, sampler=req.sampler(),
                    interactive=interactive, quiet=quiet, fresh=fresh, jsonl=as_json, cite=cite,
                    progress_factory=progress_factory(not quiet and sys.stderr.isatty(), "recompress"))
        repl.run(first=question)
    finally:
        conv.close()   # the temporary stored cache goes; a --store FILE stays


COMMANDS = [chat_cmd]
