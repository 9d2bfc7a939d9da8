"""kvcli run: one document + one instruction -> one answer on stdout."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import click

from kvcli import config, kvc, outfile
from kvcli.engines import open_session
from kvcli.apps.chat import MEMORY_STATS, Conversation, store_model
from kvcli.commands.chat import FLAGS, explicit
from kvcli.commands.options import Request, json_option, model_option, request_options
from kvcli.citations import Citations, cite_turn
from kvcli.documents import open_documents
from kvcli.errors import KvcliError
from kvcli.models import resolve_model
from kvcli.outfile import check_target
from kvcli.apps.run_document import Progress, RunResult, run_document
from kvcli.drivers.reselect_bounded import is_store


def write_atomic(path: str, text: str) -> None:
    """Write through a temporary file and rename, so an interruption never leaves half a file."""
    outfile.write(path, [text.encode("utf-8")])


@click.command("run")
@click.argument("instruction", required=False)
@click.option("--doc", "docs", multiple=True, metavar="FILE",
              help="Document(s) to read ('-' for stdin; several are joined with their names). Default: stdin.")
@model_option
@click.option("--cache", "cache_path", metavar="FILE.kvc|DIR", type=click.Path(),
              help="Answer from a stored document (instead of --doc / stdin): a .kvc file written by kvcli compress "
              "(a compressed document, or a stored full cache of compress --store, which --policy P --budget N "
              "compress again for every question; without them it is answered whole), or a store folder of a "
              "document stored in bounded chunks (compress --store -o DIR, chat --store DIR), re-selected with "
              "--policy P --budget N.")
@click.option("--question", "question_opts", multiple=True, metavar="TEXT",
              help="A question about the document (repeatable; besides or instead of INSTRUCTION). Several questions "
              "are answered one after the other, each alone, the document read once: its full cache is stored (a "
              "temporary file in kvcli's cache folder) and compressed again for every question (re-selection).")
@click.option("--questions", "questions_file", metavar="FILE", type=click.Path(dir_okay=False),
              help="Questions, one per line (blank lines skipped), as --question.")
@request_options("policy", "sampling", "cache_type", "chunking", "threads", max_tokens=256,
                 cache_type_help="llama.cpp KV cache type (native engine).")
@click.option("--system", default=config.default("system"), help="System message.")
@click.option("--no-template", is_flag=True, help="Plain-completion prompt instead of the chat template (base "
              "models; a model without a chat template gets one anyway).")
@click.option("--engine", type=click.Choice(["native", "reference"]), default="native", show_default=True)
@click.option("--out", "-o", "out_path", default=None, metavar="FILE", help="Also write the answer to FILE "
                                                                            "(atomically).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary on stderr.")
@click.option("--cite", is_flag=True, help="Under the answer, name the passages of the document it came from (page "
              "or section, lines, a quote), ranked by the attention the answer's tokens gave the kept entries. --json "
              "always carries them (\"citations\").")
@json_option
@click.pass_context
def run_cmd(ctx, req: Request, instruction, docs, cache_path, question_opts, questions_file, model, system,
            no_template, engine, out_path, quiet, cite, as_json):
    """Answer INSTRUCTION about a document, with the KV cache compressed by --policy.

    The document comes from --doc FILE (repeatable; '-' is stdin), from stdin when no --doc is
    given, or from --cache PATH (a compressed document, a stored full cache, or a store folder of a
    document stored in bounded chunks). Only the answer goes to stdout.

    Several questions (INSTRUCTION, --question, --questions FILE) are answered one after the other,
    each alone, one answer block per question on stdout (a blank line between blocks; --json: one
    object with "answers"). The document is read once (zero times from --cache): with a compressing
    policy its full cache is kept and compressed again for every question, from the prompt and the
    observation one `kvcli run` of that question reads in one prefill; a document whose full cache is
    above 256 MiB, longer than the context or --max-cache, or read with --chunk N is stored chunk by chunk
    as bounded reading reads it, and every question streams the stored chunks (as kvcli chat does). (A
    single-question run reads a document above the bounded-reading threshold in chunks instead, whose cache
    and answer may differ.)
    """
    questions = gather_questions(instruction, question_opts, questions_file)
    if len(questions) > 1 or (cache_path and explicit(ctx, "policy", "budget", "policy_args")):
        return run_questions(ctx, req, questions, docs, cache_path, model, system, no_template, engine, out_path,
                             quiet, as_json, cite)
    instruction = questions[0]
    if out_path:
        try:
            check_target(out_path)   # before the work, not after it
        except KvcliError as e:
            raise KvcliError(f"--out: {e}") from None
    model = model or config.get("model")
    stream = None if as_json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
    sampler = req.sampler()
    if cache_path:
        clash = explicit(ctx, *FLAGS, "engine")
        if clash:
            raise KvcliError(f"--cache brings its own document and compression: drop "
                             f"{FLAGS.get(clash[0], '--' + clash[0].replace('_', '-'))}")
        meta = kvc.peek_meta(cache_path)
        if is_store(cache_path) or meta and meta.get("store") and not meta.get("compressed"):
            # a stored document: answered whole (a bounded store folder asks for --policy P --budget N)
            return run_questions(ctx, req, questions, docs, cache_path, model, system, no_template, engine, out_path,
                                 quiet, as_json, cite)
        result = run_cached(cache_path, instruction, model, req.max_tokens, sampler, stream, n_threads=req.threads,
                            cite_answer=cite or as_json)
        result.stats["document_reads"] = 0
    else:
        document = open_documents(list(docs))
        path = resolve_model(model)
        compression = req.compression(path, instruction)   # checked once, before the model loads, and passed down
        session = open_session(engine, path, n_ctx=0, cache_type=req.cache_type, n_threads=req.threads) \
            if engine == "native" else open_session(engine, path, n_threads=req.threads)
        result = run_document(session, document, instruction, compression=compression,
                              max_tokens=req.max_tokens, sampler=sampler, system=system,
                              on_text=stream, show_progress=not quiet and sys.stderr.isatty(), chunk=req.chunk,
                              max_cache=req.max_cache, chunk_scoring=req.chunk_scoring, template=not no_template,
                              cite_answer=cite or as_json, announce=True)
        result.stats["document_reads"] = 1
    if as_json:
        click.echo(json.dumps(result.as_json(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
        if cite:
            print_citations(result.citations)
        sys.stdout.flush()
    if out_path:
        write_atomic(out_path, result.answer + "\n")
    if not quiet and not as_json:
        s = result.stats
        kept = f"{s['kv_cells']} cells, {s['kv_bytes'] / 1e6:.2f} MB of {s['kv_bytes_full'] / 1e6:.2f} MB"
        if s["kv_bytes_full"] and s["kv_bytes"] < s["kv_bytes_full"]:
            kept += f" ({1 - s['kv_bytes'] / s['kv_bytes_full']:.1%} saved)"
        where = f", from {cache_path}, loaded in {s['load_s']:.2f}s" if cache_path else ""
        click.echo(f"[{result.policy}{'' if result.budget is None else f' @ {result.budget}'}{where}] "
                   f"{s['prompt_tokens']} prompt tokens"
                   + (f" read in {s['chunks']} chunks of {s['chunk']} (peak {s['peak_kv_cells']} cells)"
                      if s.get("chunks") else "") + f" -> {kept}; prefill {s['prefill_s']:.2f}s, "
                   f"compress {s['compress_s']:.2f}s, {s['generated_tokens']} tokens at "
                   f"{s['decode_tok_s'] or 0:.1f} tok/s" + (f"; {s['note']}" if s.get("note") else ""), err=True)
    if result.stopped == "interrupted":
        raise KeyboardInterrupt
    if result.stopped == "context_full":
        click.echo("kvcli: the context filled up before the answer ended", err=True)


def print_citations(citations: Citations | None) -> None:
    """--cite: the cited passages under the answer (stdout, after a blank line)."""
    lines = citations.lines() if citations is not None else []
    if lines:
        sys.stdout.write("\n" + "\n".join(lines) + "\n")


def run_cached(cache_path, instruction, model, max_tokens, sampler, on_text, n_threads: int | None = None,
               cite_answer: bool = False):
    """Load a .kvc file and answer one question after its compressed document (and conversation)."""
    conv = Conversation.from_kvc(cache_path, model=model, n_threads=n_threads)
    pos0 = conv.session.seq(conv.seq).tokens_read   # tokens read before the question
    gen = conv.ask(instruction, max_tokens, sampler, on_text=on_text)
    cited = cite_turn(conv, gen) if cite_answer else None
    s = conv.stats()
    stats = {"prompt_tokens": pos0 + conv.turns[-1].tokens_in,
             "generated_tokens": len(gen.tokens),
             "kv_cells": s["kv_cells"], "kv_bytes": s["kv_bytes"], "kv_bytes_full": s["kv_bytes_full"],
             "per_layer_cells": s["per_layer_cells"], "prefill_s": round(s.get("prefill_s", 0.0), 4),
             "compress_s": 0.0, "decode_s": round(gen.decode_s, 4),
             "decode_tok_s": round(gen.decode_tok_s, 2) if gen.decode_tok_s else None,
             "load_s": round(conv.load_s, 4), "model_s": round(conv.model_s, 4), "mode": conv.mode,
             "original_tokens": len(conv.prefix_tokens), **{k: s[k] for k in MEMORY_STATS}}
    return RunResult(answer=gen.text, model=str(conv.session.model_path), policy=conv.policy, budget=conv.budget,
                     stats=stats, stopped=gen.stopped, citations=cited)


# ---------------------------------------------------------------------------------- several questions
def gather_questions(instruction, question_opts, questions_file) -> list[str]:
    """INSTRUCTION, then every --question, then the lines of --questions FILE; refused in one line when none is
    given or one is empty."""
    out = []
    if instruction is not None:
        if not instruction.strip():
            raise KvcliError("the instruction is empty")
        out.append(instruction.strip())
    for q in question_opts:
        if not q.strip():
            raise KvcliError("--question is empty")
        out.append(q.strip())
    if questions_file:
        try:
            text = Path(questions_file).expanduser().read_text(encoding="utf-8")
        except FileNotFoundError:
            raise KvcliError(f"--questions: no such file: {questions_file}") from None
        except UnicodeDecodeError:
            raise KvcliError(f"--questions {questions_file}: not UTF-8 text") from None
        except OSError as e:
            raise KvcliError(f"--questions: cannot read {questions_file}: {e.strerror}") from None
        lines = [line.strip() for line in text.splitlines() if line.strip()]
        if not lines:
            raise KvcliError(f"--questions {questions_file} holds no question (one per line)")
        out += lines
    if not out:
        raise KvcliError("no question: give INSTRUCTION, --question TEXT or --questions FILE")
    return out


def open_questions_conversation(ctx, req: Request, docs, cache_path, model, system, no_template, engine, quiet):
    """The Conversation several questions are answered from, and how many times the document was read for it:
    --cache FILE --policy P --budget N: a stored full cache, re-selected (0); --cache FILE alone: a stored full
    cache answered whole, or a compressed file as it is (0); --doc: read once and stored, re-selected (1)."""
    if cache_path:
        policy_given = explicit(ctx, "policy", "budget", "policy_args")
        meta = kvc.peek_meta(cache_path)
        store = bool(meta and meta.get("store") and not meta.get("compressed")) or is_store(cache_path)
        if policy_given or store:
            clash = [c for c in explicit(ctx, *FLAGS, "engine") if c not in ("policy", "budget", "policy_args")]
            if clash:
                raise KvcliError(f"--cache brings its own document: drop "
                                 f"{FLAGS.get(clash[0], '--' + clash[0].replace('_', '-'))}")
            policy = req.policy if policy_given else "full"
            if policy == "full" and explicit(ctx, "budget", "policy_args"):
                raise KvcliError("--budget and --policy-arg re-select with a compressing policy: add --policy P")
            budget = req.budget if policy != "full" else None
            # checked once, for the model the store is opened with, before the store is read, and passed down
            compression = replace(req, policy=policy, budget=budget).compression(store_model(cache_path, model))
            conv = Conversation.from_store(cache_path, compression=compression, n_threads=req.threads)
        else:
            clash = explicit(ctx, *FLAGS, "engine")
            if clash:
                raise KvcliError(f"--cache brings its own document and compression: drop "
                                 f"{FLAGS.get(clash[0], '--' + clash[0].replace('_', '-'))}")
            conv = Conversation.from_kvc(cache_path, model=model, n_threads=req.threads)
        return conv, 0
    if engine != "native":
        raise KvcliError("several questions re-select from the document's stored cache in the native engine: drop "
                         "--engine reference, or ask one question")
    if no_template:
        raise KvcliError("several questions are laid out with the model's chat template: drop --no-template, or ask "
                         "one question")
    path = resolve_model(model)
    compression = req.compression(path)   # checked once, before the model loads, and passed down
    document = open_documents(list(docs))
    session = open_session(engine, path, n_ctx=0, cache_type=req.cache_type, n_threads=req.threads)
    try:
        # the store's form is chat's (Reselected.store_form): the full cache kept whole, or, for a document
        # whose full cache is large, longer than the context or --max-cache, or with --chunk N, stored chunk by
        # chunk as bounded reading reads it and streamed for every question
        conv = Conversation(session, document.text, compression=compression, system=system, reselect=True,
                            max_cache=req.max_cache, chunk=req.chunk)
        conv.source = document   # its pages and sections, for the citations
        n = len(conv.prefix_tokens)
        progress = Progress(n, not quiet and sys.stderr.isatty() and n > session.n_batch)
        try:
            conv.read_store(progress=progress.update)
        finally:
            progress.close()
    except BaseException:
        session.close()
        raise
    return conv, 1


def run_questions(ctx, req: Request, questions, docs, cache_path, model, system, no_template, engine, out_path,
                  quiet, as_json, cite: bool = False):
    """Answer every question alone from one document read at most once (see open_questions_conversation)."""
    if out_path:
        try:
            check_target(out_path)
        except KvcliError as e:
            raise KvcliError(f"--out: {e}") from None
    model = model or config.get("model")
    conv, reads = open_questions_conversation(ctx, req, docs, cache_path, model, system, no_template, engine, quiet)
    conv.store_turns = False   # each question alone: no conversation to keep in the stored cache
    sampler = req.sampler()
    answers, stopped = [], None
    try:
        for i, q in enumerate(questions):
            if conv.turns:
                conv.reset()   # each question alone: the answers do not see each other
            if not as_json and i:
                sys.stdout.write("\n")   # a blank line between answer blocks
            pos0 = conv.session.seq(conv.seq).tokens_read
            gen = conv.ask(q, req.max_tokens, sampler,
                           on_text=None if as_json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush())))
            cited = cite_turn(conv, gen) if cite or as_json else None
            if not as_json:
                sys.stdout.write("\n")
                if cite:
                    print_citations(cited)
                sys.stdout.flush()
            s = conv.stats()
            row = {"prompt_tokens": conv.prompt_len if conv.reselect else pos0 + conv.turns[-1].tokens_in,
                   "generated_tokens": len(gen.tokens), "kv_cells": s["kv_cells"], "kv_bytes": s["kv_bytes"],
                   "kv_bytes_full": s["kv_bytes_full"], "decode_s": round(gen.decode_s, 4),
                   "decode_tok_s": round(gen.decode_tok_s, 2) if gen.decode_tok_s else None}
            if conv.reselect and conv.last_reselection is not None:
                row.update(conv.last_reselection.as_stats(),
                           reselect_form=conv.store.form)
            answers.append({"question": q, "answer": gen.text, "stopped": gen.stopped, "stats": row,
                            **cited_json(cited)})
            if gen.stopped in ("interrupted", "context_full"):
                stopped = gen.stopped
                break
        s = conv.stats()
        store = conv.store if conv.reselect else None
        mode = "restored" if conv.reselect and conv.budget is None else conv.mode   # full: the whole stored cache
        stats = {"document_reads": reads, "questions": len(questions), "answered": len(answers),
                 "mode": mode, "original_tokens": len(conv.prefix_tokens),
                 "read_s": round(store.read_s, 4) if store is not None and reads else 0.0,
                 "load_s": round(conv.load_s, 4) if conv.load_s is not None else None,
                 "model_s": round(conv.model_s, 4) if conv.model_s is not None else None,
                 "store_bytes": store.nbytes if store is not None else None,
                 "reselect_s": round(sum(a["stats"].get("reselect_s", 0.0) for a in answers), 4),
                 "generated_tokens": sum(a["stats"]["generated_tokens"] for a in answers),
                 **{k: s[k] for k in MEMORY_STATS}}
    finally:
        conv.close()   # a temporary stored cache goes; a --cache file stays
    label = conv.policy if conv.budget is None else f"{conv.policy} @ {conv.budget}"
    if as_json:
        if len(questions) == 1:   # the one-answer object of kvcli run, with the re-selection's figures
            a = answers[0]
            click.echo(json.dumps({"answer": a["answer"], "model": str(conv.session.model_path), "policy": conv.policy,
                                   "budget": conv.budget, "stopped": a["stopped"], "stats": {**a["stats"], **stats},
                                   **{k: a[k] for k in ("citations", "citations_note") if k in a}},
                                  ensure_ascii=False))
        else:
            click.echo(json.dumps({"model": str(conv.session.model_path), "policy": conv.policy, "budget": conv.budget,
                                   "answers": answers, "stats": stats}, ensure_ascii=False))
    if out_path:
        write_atomic(out_path, "\n\n".join(a["answer"] for a in answers) + "\n")
    if not quiet and not as_json:
        if not conv.reselect:
            how = f"each answered alone after the {conv.mode} compressed cache"
        elif conv.budget is None:
            how = "each answered from the whole stored document"
        else:
            how = f"each answered from a cache re-selected for it ({stats['reselect_s']:.2f}s of re-selection in all)"
        if reads:
            read = (f"document read once in {stats['read_s']:.2f}s and stored ({stats['store_bytes'] / 1e6:.2f} MB, "
                    "deleted at exit)")
        else:
            read = f"document read 0 times: {cache_path} loaded in {stats['load_s'] or 0:.2f}s"
        click.echo(f"[{label}, {mode}] {stats['original_tokens']} tokens; {read}; {len(answers)} of "
                   f"{len(questions)} question(s), {how}; {stats['generated_tokens']} answer tokens", err=True)
    if stopped == "interrupted":
        raise KeyboardInterrupt
    if stopped == "context_full":
        raise KvcliError("the context filled up before an answer ended: lower --max-tokens")


def cited_json(cited: Citations | None) -> dict:
    """The "citations" (and "citations_note") fields of an answer's JSON object."""
    if cited is None:
        return {}
    return {"citations": cited.as_json(), **({"citations_note": cited.note} if cited.note else {})}


COMMANDS = [run_cmd]
