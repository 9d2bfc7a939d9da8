"""kvcli run: one document + one instruction -> one answer on stdout."""
from __future__ import annotations

import json
import sys

import click

from kvcli import config, outfile
from kvcli.chat import MEMORY_STATS, Conversation
from kvcli.commands.chat import FLAGS, explicit
from kvcli.commands.options import Request, json_option, model_option, request_options
from kvcli.documents import read_documents
from kvcli.errors import KvcliError
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession
from kvcli.outfile import check_target
from kvcli.pipeline import RunResult, run_document


def open_session(engine: str, model: str | None, **kw):
    path = resolve_model(model)
    if engine == "native":
        return NativeSession(path, **kw)
    if engine == "reference":
        from kvcli.reference.session import ReferenceSession  # noqa: PLC0415
        return ReferenceSession(path, **{k: v for k, v in kw.items() if k in ("n_ctx", "n_threads")})
    raise KvcliError(f"unknown engine '{engine}'")


def write_atomic(path: str, text: str) -> None:
    """Write through a temporary file and rename, so an interruption never leaves half a file."""
    outfile.write(path, [text.encode("utf-8")])


@click.command("run")
@click.argument("instruction")
@click.option("--doc", "docs", multiple=True, metavar="FILE",
              help="Document(s) to read ('-' for stdin; several are joined with their names). Default: stdin.")
@model_option
@click.option("--cache", "cache_path", metavar="FILE.kvc", type=click.Path(dir_okay=False),
              help="Answer from a compressed document written by kvcli compress (instead of --doc / stdin).")
@request_options("policy", "sampling", "cache_type", "chunking", "threads", max_tokens=256,
                 cache_type_help="llama.cpp KV cache type (native engine).")
@click.option("--system", default=config.default("system"), help="System message.")
@click.option("--no-template", is_flag=True, help="Plain-completion prompt instead of the chat template (base "
              "models; a model without a chat template gets one anyway).")
@click.option("--engine", type=click.Choice(["native", "reference"]), default="native", show_default=True)
@click.option("--out", "-o", "out_path", default=None, metavar="FILE", help="Also write the answer to FILE (atomically).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary on stderr.")
@json_option
@click.pass_context
def run_cmd(ctx, req: Request, instruction, docs, cache_path, model, system, no_template, engine, out_path, quiet,
            as_json):
    """Answer INSTRUCTION about a document, with the KV cache compressed by --policy.

    The document comes from --doc FILE (repeatable; '-' is stdin), from stdin when no --doc is
    given, or from a compressed --cache FILE.kvc. Only the answer goes to stdout.
    """
    if not instruction.strip():
        raise KvcliError("the instruction is empty")
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
        result = run_cached(cache_path, instruction, model, req.max_tokens, sampler, stream, n_threads=req.threads)
    else:
        document = read_documents(list(docs))
        session = open_session(engine, model, n_ctx=0, cache_type=req.cache_type, n_threads=req.threads) \
            if engine == "native" else open_session(engine, model, n_threads=req.threads)
        result = run_document(session, document, instruction, policy=req.policy, budget=req.budget,
                              policy_args=req.policy_args, max_tokens=req.max_tokens, sampler=sampler, system=system,
                              on_text=stream, show_progress=not quiet and sys.stderr.isatty(), chunk=req.chunk,
                              max_cache=req.max_cache, chunk_scoring=req.chunk_scoring, template=not no_template)
    if as_json:
        click.echo(json.dumps(result.as_json(), ensure_ascii=False))
    else:
        sys.stdout.write("\n")
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


def run_cached(cache_path, instruction, model, max_tokens, sampler, on_text, n_threads: int | None = None):
    """Load a .kvc file and answer one question after its compressed document (and conversation)."""
    conv = Conversation.from_kvc(cache_path, model=model, n_threads=n_threads)
    pos0 = conv.session.seq(conv.seq).tokens_read   # tokens read before the question
    gen = conv.ask(instruction, max_tokens, sampler, on_text=on_text)
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
                     stats=stats, stopped=gen.stopped)


COMMANDS = [run_cmd]
