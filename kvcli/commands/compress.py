"""kvcli compress: prefill and compress a document once, save it as a .kvc file for chat/run --cache."""
from __future__ import annotations

import json
import sys
import time

import click

from kvcli import config, doc_formats, policies
from kvcli.apps.chat import MEMORY_STATS, Conversation
from kvcli.commands.chat import explicit, open_conversation
from kvcli.commands.options import Request, json_option, model_option, request_options
from kvcli.documents import read_documents
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import peak_rss_bytes
from kvcli.models import resolve_model
from kvcli.engines import open_native
from kvcli.planning.planner import resolve
from kvcli.outfile import check_target
from kvcli.apps.run_document import Progress
from kvcli.drivers.reselect import STORE_TAIL, StoredDocument
from kvcli.drivers.reselect_bounded import MANIFEST, check_store_target


@click.command("compress")
@click.option("--doc", "docs", multiple=True, metavar="FILE",
              help="Document(s) to compress ('-' for stdin; several are joined with their names). Default: stdin.")
@click.option("--output", "-o", "out_path", required=True, metavar="FILE.kvc", help="Where to write the cache file "
              "(with --store: the stored document, a .kvc file or, stored in bounded chunks, a folder).")
@model_option
@request_options("policy", "cache_type", "chunking", "threads")
@click.option("--question", metavar="TEXT", help="Compress for this question (question-aware); without it the "
              "document is compressed with a generic instruction (question-agnostic).")
@click.option("--system", default=config.default("system"), help="System message (before the document).")
@click.option("--store", is_flag=True, help="Store the document instead of compressing it: kvcli run/chat --cache "
              "PATH --policy P --budget N then compress it again for every question, without reading the document "
              "again. A document whose full cache fits (the model's context, 256 MiB) is stored whole, as one .kvc "
              "file; one longer than the context, above 256 MiB, or with --chunk N / --max-cache is stored in "
              "bounded chunks as bounded reading reads it, which needs --policy P --budget N (a window policy, "
              "for the reading): -o names a folder, written with store.json (model, tokens, each chunk's SHA-256) "
              "and one file per chunk.")
@click.option("--colsum", is_flag=True, help="With --store: also store the attention column sums that the column-sum "
              "policies score by (h2o and the others `kvcli policies --explain` says observe colsum; stored anyway "
              "when --policy is one of them), so that every policy can re-select from the "
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
    if store:   # a file or a folder: which one is known once the document is tokenized (checked again then)
        out = check_store_target(out_path, force)
        return store_document(ctx, req, docs, out, force, model, question, system, colsum, quiet, as_json)
    out = check_target(out_path, force)   # a fast refusal; the write checks again when the file appears
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


def store_document(ctx, req: Request, docs, out, force, model, question, system, colsum, quiet, as_json):
    """compress --store: read the document once and store it: its full cache in a .kvc file with a store section
    (kvcli/drivers/reselect.py), or, where `kvcli chat` would re-select it in bounded chunks, chunk by chunk in a
    store folder (kvcli/drivers/reselect_bounded.py), read with --policy P --budget N."""
    if question:
        raise KvcliError("--store keeps the document's full cache for any question: drop --question (ask it with "
                         "kvcli run --cache FILE --policy P --budget N QUESTION)")
    if explicit(ctx, "chunk_scoring"):
        raise KvcliError("--store reads a document in bounded chunks scored by each chunk's own window (no question "
                         "is known yet): drop --chunk-scoring")
    policy = req.policy if explicit(ctx, "policy") else "full"
    budget = req.budget if explicit(ctx, "budget") and policy != "full" else None
    if explicit(ctx, "budget") and policy == "full":
        raise KvcliError("--budget with --store is the budget bounded reading keeps while it reads: add --policy P")
    if budget is None and explicit(ctx, "policy_args"):
        raise KvcliError("--store keeps every entry of a document stored whole: drop --policy-arg (the policy is "
                         "chosen when asking: kvcli run --cache FILE --policy P --budget N)")
    if policy != "full":
        colsum = colsum or "colsum" in policies.get(policy).needs
    path = resolve_model(model or config.get("model"))
    # the compression bounded reading reads with, checked once, before the document is read, and passed down
    compression = resolve(path, policy if budget is not None else "full", budget,
                          req.policy_args if budget is not None else {})
    document = read_documents(list(docs))
    session = open_native(path, n_ctx=0, cache_type=req.cache_type, n_threads=req.threads)
    try:
        conv = Conversation(session, document, compression=compression, system=system, reselect=True,
                            store_path=out, chunk=req.chunk, max_cache=req.max_cache)
        n, limit = len(conv.prefix_tokens), session.n_ctx_train
        if budget is None:
            if n + STORE_TAIL + 64 > limit or req.chunk or req.max_cache is not None:
                why = f"the document is {n} tokens, longer than the model's context ({limit} tokens)" \
                    if n + STORE_TAIL + 64 > limit else ("--chunk N" if req.chunk else "--max-cache")
                raise KvcliError(f"{why}: it is stored in bounded chunks, read by bounded reading, which compresses "
                                 "as it reads: give --policy P --budget N (a window policy; the questions may use "
                                 "another)")
            form = "exact"
        else:
            form = conv.store_form(conv._cfg(None))[0]
            if form == "exact":
                raise KvcliError(f"this document ({n} tokens) is stored whole, its full cache fitting the context "
                                 "(the exact form), which keeps every entry: drop --budget (the policy and budget "
                                 "are chosen when asking: kvcli run --cache FILE --policy P --budget N), or add "
                                 "--chunk N to store it in bounded chunks")
            if colsum and explicit(ctx, "colsum"):
                raise KvcliError("a document stored in bounded chunks serves window policies only: drop --colsum")
        out = check_store_target(out, force, form)
        progress = Progress(n, not quiet and sys.stderr.isatty(), "read")
        t0 = time.perf_counter()
        try:   # a file that cannot be written is an error here (not a cache kept in memory, as chat may)
            if form == "bounded":
                conv.read_store(progress=progress)
                st = conv.store
            else:
                session.create_context(min(limit, -(-(n + 1) // 256) * 256))
                key = conv._announce("prefill", "reading it in one prefill", 0)
                t1 = time.perf_counter()
                st = StoredDocument.read(session, conv.prefix_tokens, colsum=colsum, path=out, keep=True,
                                         progress=progress.update, meta={"document": document, "system": system})
                doc_formats.record_read_speed(key, n, time.perf_counter() - t1)
        finally:
            progress.close()
        total_s = time.perf_counter() - t0
        size = st.nbytes + (out / MANIFEST).stat().st_size if form == "bounded" else out.stat().st_size
        if not quiet:
            what = (f"a folder of {len(st.chunks)} chunk files + {MANIFEST}: {st.split} tokens read in bounded chunks "
                    f"of {st.chunk} with {policy} @ {budget}" if form == "bounded" else
                    f"the full cache of {st.split} tokens{' with their column sums' if st.colsum is not None else ''}")
            click.echo(f"wrote {out} ({size / 1e6:.2f} MB): {what}, read in {st.read_s:.2f}s; "
                       f"kvcli run --cache {out} --policy P --budget N QUESTION re-selects from it", err=True)
        if as_json:
            click.echo(json.dumps({
                "file": str(out), "file_bytes": size, "model": session.model_path, "policy": "full", "budget": None,
                "mode": "stored", "form": form, "original_tokens": n,
                "stored_tokens": st.split, "colsum": st.colsum is not None,
                **({"chunks": len(st.chunks), "chunk": st.chunk, "read_policy": policy, "read_budget": budget}
                   if form == "bounded" else {}),
                "stats": {"store_bytes": st.nbytes, "read_s": round(st.read_s, 4),
                          "save_s": round(total_s - st.read_s, 4), "peak_rss_bytes": peak_rss_bytes()},
            }, ensure_ascii=False))
    finally:
        session.close()


COMMANDS = [compress_cmd]
