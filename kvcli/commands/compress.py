"""kvcli compress: prefill and compress a document once, save it as a .kvc file for chat/run --cache."""
from __future__ import annotations

import json
import sys
import time

import click

from kvcli import config, policies
from kvcli.apps.chat import MEMORY_STATS, Conversation
from kvcli.commands.chat import explicit, open_conversation
from kvcli.commands.options import Request, json_option, model_option, request_options
from kvcli.documents import read_documents
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import peak_rss_bytes
from kvcli.models import resolve_model
from kvcli.native.session import NativeSession
from kvcli.outfile import check_target
from kvcli.apps.pipeline import Progress
from kvcli.drivers.reselect import STORE_TAIL, StoredDocument


@click.command("compress")
@click.option("--doc", "docs", multiple=True, metavar="FILE",
              help="Document(s) to compress ('-' for stdin; several are joined with their names). Default: stdin.")
@click.option("--output", "-o", "out_path", required=True, metavar="FILE.kvc", help="Where to write the cache file.")
@model_option
@request_options("policy", "cache_type", "chunking", "threads")
@click.option("--question", metavar="TEXT", help="Compress for this question (question-aware); without it the "
              "document is compressed with a generic instruction (question-agnostic).")
@click.option("--system", default=config.default("system"), help="System message (before the document).")
@click.option("--store", is_flag=True, help="Store the document's full cache instead of compressing it: kvcli run/"
              "chat --cache FILE --policy P --budget N then compress it again for every question, without reading "
              "the document again. The document must fit the model's context.")
@click.option("--colsum", is_flag=True, help="With --store: also store the attention column sums that h2o and d2o "
              "score by (stored anyway when --policy is one of them), so that every policy can re-select from the "
              "file. Observing them makes the read slower: 1.4x to 2x on the default model (2,048 tokens, 2 "
              "threads on a busy machine: 34-47 s without, 48-74 s with), and the file larger by 4.7% (11% for "
              "qwen2.5-coder-0.5b).")
@click.option("--force", "-f", is_flag=True, help="Overwrite an existing output file.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary on stderr.")
@json_option
@click.pass_context
def compress_cmd(ctx, req: Request, docs, out_path, model, question, system, store, colsum, force, quiet, as_json):
    """Compress a document once and save it (kvcli chat --cache / kvcli run --cache load it in well under a second).

    With --store the document's full cache is saved instead (read once, never compressed), for
    kvcli run/chat --cache FILE --policy P --budget N to compress it for each question they ask.
    """
    if colsum and not store:
        raise KvcliError("--colsum stores column sums beside a document's full cache: add --store")
    out = check_target(out_path, force)   # a fast refusal; the write checks again when the file appears
    if store:
        return store_document(ctx, req, docs, out, model, question, system, colsum, quiet, as_json)
    conv = open_conversation(docs=docs, cache_path=None, model=model, req=req, system=system,
                             question=(question or "").strip() or None,
                             show_progress=not quiet and sys.stderr.isatty(), quiet=quiet)
    t0 = time.perf_counter()
    size = conv.save(out, force=force)
    save_s = time.perf_counter() - t0
    if not quiet:
        click.echo(f"wrote {out} ({size / 1e6:.2f} MB) in {save_s:.2f}s", err=True)
    if as_json:
        s = conv.stats()
        click.echo(json.dumps({
            "file": str(out), "file_bytes": size, "model": conv.session.model_path, "policy": conv.policy,
            "budget": conv.budget, "mode": conv.mode, "original_tokens": len(conv.prefix_tokens),
            "stats": {k: s[k] for k in ("kv_cells", "kv_bytes", "kv_bytes_full", "per_layer_cells", "live_entries",
                                        *MEMORY_STATS)}
            | conv.report.as_stats()
            | {"prefill_s": round(conv.report.prefill_s, 4), "compress_s": round(conv.report.compress_s, 4),
               "save_s": round(save_s, 4)},
        }, ensure_ascii=False))


def store_document(ctx, req: Request, docs, out, model, question, system, colsum, quiet, as_json):
    """compress --store: read the document once and write its full cache with a store section (kvcli/drivers/reselect.py)."""
    if question:
        raise KvcliError("--store keeps the document's full cache for any question: drop --question (ask it with "
                         "kvcli run --cache FILE --policy P --budget N QUESTION)")
    clash = explicit(ctx, "budget", "policy_args", "chunk", "max_cache", "chunk_scoring")
    if clash:
        flag = {"budget": "--budget", "policy_args": "--policy-arg", "chunk": "--chunk", "max_cache": "--max-cache",
                "chunk_scoring": "--chunk-scoring"}[clash[0]]
        raise KvcliError(f"--store keeps every entry of the document, read in one prefill: drop {flag} (the policy "
                         "and budget are chosen when asking: kvcli run --cache FILE --policy P --budget N)")
    policy = req.policy if explicit(ctx, "policy") else "full"
    if policy != "full":
        colsum = colsum or "colsum" in policies.get(policy).needs
    document = read_documents(list(docs))
    session = NativeSession(resolve_model(model or config.get("model")), n_ctx=0, cache_type=req.cache_type,
                            n_threads=req.threads)
    try:
        conv = Conversation(session, document, policy="full", system=system, reselect=True, store_path=out)
        n, limit = len(conv.prefix_tokens), session.n_ctx_train
        if n + STORE_TAIL + 64 > limit:
            raise KvcliError(f"the document is {n} tokens: a stored document keeps its full cache in the model's "
                             f"context ({limit} tokens); compress it with a policy instead (--policy P --budget N)")
        session.create_context(min(limit, -(-(n + 1) // 256) * 256))
        progress = Progress(n, not quiet and sys.stderr.isatty(), "read")
        t0 = time.perf_counter()
        try:   # a file that cannot be written is an error here (not a cache kept in memory, as chat may)
            st = StoredDocument.read(session, conv.prefix_tokens, colsum=colsum, path=out, keep=True,
                                     progress=progress.update, meta={"document": document, "system": system})
        finally:
            progress.close()
        total_s = time.perf_counter() - t0
        size = out.stat().st_size
        if not quiet:
            click.echo(f"wrote {out} ({size / 1e6:.2f} MB): the full cache of {st.split} tokens"
                       f"{' with their column sums' if st.colsum is not None else ''}, read in {st.read_s:.2f}s; "
                       f"kvcli run --cache {out} --policy P --budget N QUESTION re-selects from it", err=True)
        if as_json:
            click.echo(json.dumps({
                "file": str(out), "file_bytes": size, "model": session.model_path, "policy": "full", "budget": None,
                "mode": "stored", "original_tokens": n, "stored_tokens": st.split, "colsum": st.colsum is not None,
                "stats": {"store_bytes": st.nbytes, "read_s": round(st.read_s, 4),
                          "save_s": round(total_s - st.read_s, 4), "peak_rss_bytes": peak_rss_bytes()},
            }, ensure_ascii=False))
    finally:
        session.close()


COMMANDS = [compress_cmd]
