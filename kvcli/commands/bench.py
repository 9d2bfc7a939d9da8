"""kvcli bench: speed, memory and quality of policies x budgets x cache types, measured on your documents."""
from __future__ import annotations

import json
import sys

import click

from kvcli.drivers import bench
from kvcli.commands.options import Request, json_option, model_option, request_options
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import parse_list
from kvcli.evaluation.report import check_png, plot_bench
from kvcli.models import resolve_model

CACHE_CHOICES = ("f16", "q8_0", "q4_0")


@click.command("bench")
@click.option("--docs", "docs", required=True, metavar="FILES|DIR",
              help="Documents: comma-separated files, or a directory of *.txt/.md/.pdf/.epub/.docx/.html files.")
@model_option
@request_options("policies", "threads", "chunk", chunk_help="Read every document in chunks of N tokens, compressing "
                 "after each (kvcli/drivers/chunked.py), so documents longer than the context can be measured; implies "
                 "--no-share-prefill.")
@click.option("--cache-type", "cache_types", default="f16", show_default=True,
              help="Comma-separated llama.cpp KV cache types among f16, q8_0, q4_0 (each combined with every "
                   "policy).")
@click.option("--gen", type=click.IntRange(1, 4096), default=32, show_default=True,
              help="Tokens decoded per configuration (teacher-forced on the full cache's greedy continuation).")
@click.option("--repeat", type=click.IntRange(1, 100), default=3, show_default=True,
              help="Decode repeats (median, min-max are reported).")
@click.option("--batch", type=click.IntRange(0, 256), default=0, show_default=True,
              help="Equal-memory batch test: hold up to N documents in --ctx cells and decode them together "
                   "(0: off).")
@click.option("--ctx", type=click.IntRange(64, 1 << 20), default=None,
              help="Total cache cells for the batch test. Default: what the longest document needs uncompressed.")
@click.option("--instruction", default=None, help="Instruction appended to every document.")
@click.option("--share-prefill/--no-share-prefill", default=True, show_default=True,
              help="Time one prefill per cache type and observation (budgets never change the prefill), and "
                   "compress each configuration from a restored copy of it; --no-share-prefill prefills every "
                   "configuration on its own through kvcli.drivers.compress.prefill_and_compress.")
@click.option("--csv", "csv_path", default=None, metavar="FILE", help="Also write the rows as CSV.")
@click.option("--json-out", "json_path", default=None, metavar="FILE", help="Also write the full result as JSON.")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png",
              help="PNG plots: decode tok/s and agreement vs budget, KV bytes (and FILE-batch.png with --batch).")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
@json_option
def bench_cmd(req: Request, docs, model, cache_types, gen, repeat, batch, ctx, instruction, share_prefill, csv_path,
              json_path, plot_path, quiet, as_json):
    """Measure prefill, compression and decode speed, KV bytes, peak RSS and quality against the full
    cache, per policy x budget x cache type (the full f16 cache is always measured: it is the baseline)."""
    cts = parse_list(cache_types, "--cache-type", lambda s: s.lower())
    for ct in cts:
        if ct not in CACHE_CHOICES:
            raise KvcliError(f"--cache-type: unknown cache type '{ct}' (choose from {', '.join(CACHE_CHOICES)})")
    if ctx is not None and not batch:
        raise KvcliError("--ctx sets the cache of the batch test: give --batch N too")
    check_png(plot_path)
    path = resolve_model(model)
    documents = bench.load_docs([p for p in docs.split(",") if p.strip()] if "," in docs else [docs])
    b = bench.Bench(path, documents, req.policies, req.budgets, cts, gen=gen, repeat=repeat, batch=batch, ctx=ctx,
                    policy_args=req.scoped_args, instruction=instruction or bench.BENCH_INSTRUCTION,
                    threads=req.threads, share_prefill=share_prefill, log=None if quiet else bench.log_stderr,
                    chunk=req.chunk, chunk_scoring=req.chunk_scoring)
    result = b.run()
    if as_json:
        click.echo(json.dumps(result, default=bench._jsonable))
    else:
        click.echo(bench.table(result))
    if json_path:
        bench.write_json(result, json_path)
    if csv_path:
        bench.write_csv(result, csv_path)
    if plot_path:
        plot_bench(result, plot_path)
        if not quiet:
            click.echo(f"plots written to {plot_path}", err=True)
    sys.stdout.flush()


COMMANDS = [bench_cmd]
