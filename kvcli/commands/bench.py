"""kvcli bench: speed, memory and quality of policies x budgets x cache types, measured on your documents."""
from __future__ import annotations

import json
import sys

import click

from kvcli.commands.options import chunk_scoring_option, json_option, model_option
from kvcli.errors import KvcliError

CACHE_CHOICES = ("f16", "q8_0", "q4_0")


def parse_scoped_args(items) -> dict:
    """--policy-arg POLICY.KEY=VALUE (repeatable) -> {policy: {key: value}}."""
    out: dict[str, dict] = {}
    for item in items:
        lhs, sep, value = item.partition("=")
        pol, dot, key = lhs.partition(".")
        if not sep or not dot or not pol.strip() or not key.strip():
            raise KvcliError(f"--policy-arg expects POLICY.KEY=VALUE (e.g. snapkv.window=32), got '{item}'")
        out.setdefault(pol.strip().lower(), {})[key.strip()] = value.strip()
    return out


def common_lists(policies, budgets):
    from kvcli.evaluation.measure import parse_int_list, parse_list  # noqa: PLC0415
    pols = parse_list(policies, "--policies", lambda s: s.lower())
    buds = parse_int_list(budgets, "--budgets")
    if any(p != "full" for p in pols) and not buds:
        raise KvcliError("--budgets is needed for policies other than full")
    return pols, buds


@click.command("bench")
@click.option("--docs", "docs", required=True, metavar="FILES|DIR",
              help="Documents: comma-separated files, or a directory of *.txt/*.md.")
@model_option
@click.option("--policies", default="full,snapkv", show_default=True, help="Comma-separated policies.")
@click.option("--budgets", default="128,256,512", show_default=True,
              help="Comma-separated budgets (entries kept per layer and KV head).")
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
@click.option("--policy-arg", "policy_args", multiple=True, metavar="POLICY.KEY=VALUE",
              help="Policy parameter, e.g. snapkv.window=32 (repeatable).")
@click.option("--instruction", default=None, help="Instruction appended to every document.")
@click.option("--threads", type=click.IntRange(1, 1024), default=None, help="CPU threads (default: all cores).")
@click.option("--share-prefill/--no-share-prefill", default=True, show_default=True,
              help="Time one prefill per cache type and observation (budgets never change the prefill), and "
                   "compress each configuration from a restored copy of it; --no-share-prefill prefills every "
                   "configuration on its own through kvcli.compress.prefill_and_compress.")
@click.option("--chunk", type=click.IntRange(0), default=None, metavar="N",
              help="Read every document in chunks of N tokens, compressing after each (kvcli/chunked.py), so "
                   "documents longer than the context can be measured; implies --no-share-prefill.")
@chunk_scoring_option
@click.option("--csv", "csv_path", default=None, metavar="FILE", help="Also write the rows as CSV.")
@click.option("--json-out", "json_path", default=None, metavar="FILE", help="Also write the full result as JSON.")
@click.option("--plot", "plot_path", default=None, metavar="FILE.png",
              help="PNG plots: decode tok/s and agreement vs budget, KV bytes (and FILE-batch.png with --batch).")
@click.option("--quiet", "-q", is_flag=True, help="No progress lines on stderr.")
@json_option
def bench_cmd(docs, model, policies, budgets, cache_types, gen, repeat, batch, ctx, policy_args, instruction,
              threads, share_prefill, chunk, chunk_scoring, csv_path, json_path, plot_path, quiet, as_json):
    """Measure prefill, compression and decode speed, KV bytes, peak RSS and quality against the full
    cache, per policy x budget x cache type (the full f16 cache is always measured: it is the baseline)."""
    from kvcli import bench  # noqa: PLC0415
    from kvcli.evaluation.measure import parse_list  # noqa: PLC0415
    from kvcli.evaluation.report import check_png, plot_bench  # noqa: PLC0415
    from kvcli.models import resolve_model  # noqa: PLC0415

    pols, buds = common_lists(policies, budgets)
    cts = parse_list(cache_types, "--cache-type", lambda s: s.lower())
    for ct in cts:
        if ct not in CACHE_CHOICES:
            raise KvcliError(f"--cache-type: unknown cache type '{ct}' (choose from {', '.join(CACHE_CHOICES)})")
    if ctx is not None and not batch:
        raise KvcliError("--ctx sets the cache of the batch test: give --batch N too")
    check_png(plot_path)
    path = resolve_model(model)
    documents = bench.load_docs([p for p in docs.split(",") if p.strip()] if "," in docs else [docs])
    b = bench.Bench(path, documents, pols, buds, cts, gen=gen, repeat=repeat, batch=batch, ctx=ctx,
                    policy_args=parse_scoped_args(policy_args), instruction=instruction or bench.BENCH_INSTRUCTION,
                    threads=threads, share_prefill=share_prefill, log=None if quiet else bench.log_stderr,
                    chunk=chunk, chunk_scoring=chunk_scoring)
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
