"""kvcli compress: prefill and compress a document once, save it as a .kvc file for chat/run --cache."""
from __future__ import annotations

import json
import sys
import time

import click

from kvcli import config
from kvcli.commands.chat import policy_option
from kvcli.commands.options import chunk_options, json_option, model_option
from kvcli.errors import KvcliError


@click.command("compress")
@click.option("--doc", "docs", multiple=True, metavar="FILE",
              help="Document(s) to compress ('-' for stdin; several are joined with their names). Default: stdin.")
@click.option("--output", "-o", "out_path", required=True, metavar="FILE.kvc", help="Where to write the cache file.")
@model_option
@policy_option
@click.option("--budget", "-b", type=click.IntRange(1), default=config.default("budget"),
              help="Entries kept per layer and KV head, observation window included. Default: $KVCLI_BUDGET.")
@click.option("--policy-arg", "policy_args", multiple=True, metavar="KEY=VALUE", help="Policy parameter (repeatable).")
@click.option("--question", metavar="TEXT", help="Compress for this question (question-aware); without it the "
              "document is compressed with a generic instruction (question-agnostic).")
@click.option("--system", default=config.default("system"), help="System message (before the document).")
@click.option("--cache-type", type=click.Choice(["f16", "q8_0", "q4_0", "f32"]), default="f16", show_default=True,
              help="llama.cpp KV cache type.")
@chunk_options
@click.option("--force", "-f", is_flag=True, help="Overwrite an existing output file.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary on stderr.")
@json_option
def compress_cmd(docs, out_path, model, policy, budget, policy_args, question, system, cache_type, chunk, max_cache,
                 chunk_scoring, force, quiet, as_json):
    """Compress a document once and save it (kvcli chat --cache / kvcli run --cache load it in well under a second)."""
    from pathlib import Path  # noqa: PLC0415

    from kvcli.chat import MEMORY_STATS  # noqa: PLC0415
    from kvcli.commands.chat import open_conversation  # noqa: PLC0415
    from kvcli.policies import parse_policy_args  # noqa: PLC0415

    from kvcli.outfile import check_target  # noqa: PLC0415
    out = check_target(out_path, force)   # a fast refusal; the write checks again when the file appears
    policy = (policy or "full").lower()
    conv = open_conversation(docs=docs, cache_path=None, model=model, policy=policy,
                             budget=None if policy == "full" else budget,
                             policy_args=parse_policy_args(list(policy_args)), system=system,
                             question=(question or "").strip() or None, cache_type=cache_type, chunk=chunk,
                             max_cache=max_cache, chunk_scoring=chunk_scoring,
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
