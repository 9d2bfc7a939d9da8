"""kvcli compress: prefill and compress a document once, save it as a .kvc file for chat/run --cache."""
from __future__ import annotations

import json
import sys
import time

import click

from kvcli import config
from kvcli.chat import MEMORY_STATS
from kvcli.commands.chat import open_conversation
from kvcli.commands.options import Request, json_option, model_option, request_options
from kvcli.outfile import check_target


@click.command("compress")
@click.option("--doc", "docs", multiple=True, metavar="FILE",
              help="Document(s) to compress ('-' for stdin; several are joined with their names). Default: stdin.")
@click.option("--output", "-o", "out_path", required=True, metavar="FILE.kvc", help="Where to write the cache file.")
@model_option
@request_options("policy", "cache_type", "chunking", "threads")
@click.option("--question", metavar="TEXT", help="Compress for this question (question-aware); without it the "
              "document is compressed with a generic instruction (question-agnostic).")
@click.option("--system", default=config.default("system"), help="System message (before the document).")
@click.option("--force", "-f", is_flag=True, help="Overwrite an existing output file.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary on stderr.")
@json_option
def compress_cmd(req: Request, docs, out_path, model, question, system, force, quiet, as_json):
    """Compress a document once and save it (kvcli chat --cache / kvcli run --cache load it in well under a second)."""
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


COMMANDS = [compress_cmd]
