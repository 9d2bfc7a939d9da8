"""kvcli batch: one instruction (or several questions) over many documents -> one JSON line per answer."""
from __future__ import annotations

import json
import sys

import click

from kvcli import config
from kvcli.apps import batch_ray
from kvcli.apps.batch import Batch, ResultsFile, Settings, list_documents, read_manifest
from kvcli.apps.batch_ray import import_ray
from kvcli.commands.options import Request, json_option, model_option, request_options
from kvcli.commands.run import gather_questions
from kvcli.errors import KvcliError


@click.command("batch")
@click.option("--docs", "docs", multiple=True, metavar="DIR|GLOB|FILE|-",
              help="Documents: a folder (its *.txt/.md/.text/.rst/.pdf/.epub/.docx/.html/.htm files, recursively), a "
                   "quoted glob pattern, a file, or '-' for a list of paths on stdin, one per line. Repeatable.")
@click.option("--manifest", "manifest", metavar="FILE.jsonl", type=click.Path(dir_okay=False),
              help='Documents and their own questions instead of --docs: one {"path": ..., "questions": [...]} per '
                   "line (a relative path from the manifest's folder); each document is read once for its questions "
                   "(and those of -i/--question/--questions, asked of every document).")
@click.option("--instruction", "-i", default=None, help="The instruction applied to every document.")
@click.option("--question", "question_opts", multiple=True, metavar="TEXT",
              help="A question asked of every document (repeatable; besides or instead of --instruction). With "
                   "several, each document is read once and every question answered alone from a cache re-selected "
                   "for it (kvcli run's several questions): one line per document and question.")
@click.option("--questions", "questions_file", metavar="FILE", type=click.Path(dir_okay=False),
              help="Questions asked of every document, one per line, as --question.")
@click.option("--out", "-o", "out_path", required=True, metavar="FILE.jsonl", type=click.Path(dir_okay=False),
              help="Results, one JSON line per document (path, answer, stats, error), appended as each finishes. "
                   "Documents it already answers (same path, content and settings) are skipped.")
@model_option
# the flags and defaults of `kvcli run` (sampling: llama.cpp's chain, greedy with DRY; reading:
# kvcli/drivers/chunked.py)
@request_options("policy", "sampling", "cache_type", "chunking", "threads", max_tokens=256,
                 max_tokens_help="Most tokens of each answer (reserved in the cache for every held document).")
@click.option("--system", default=config.default("system"), help="System message.")
@click.option("--parallel", type=click.IntRange(0, 256), default=0, metavar="N",
              help="Most documents held and decoded at once. Default: as many as --max-cache holds (at most 64).")
@click.option("--retry-errors", is_flag=True, help="Also redo the documents --out holds an error line for.")
@click.option("--ray", "ray_address", default=None, metavar="ADDRESS|auto|local",
              help="Run on a Ray cluster (pip install 'kvcli[ray]'): its address, 'auto' for the cluster this machine "
                   "belongs to, or 'local' to start one on this machine.")
@click.option("--ray-workers", type=click.IntRange(1), default=None, metavar="N",
              help="Ray workers (each with its model and cache). Default: one per node, or one per --ray-cpus cores.")
@click.option("--ray-cpus", type=click.IntRange(1), default=None, metavar="C",
              help="CPU cores (and threads) of each Ray worker.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary on stderr.")
@json_option
def batch_cmd(req: Request, docs, manifest, instruction, question_opts, questions_file, out_path, model, system,
              parallel, retry_errors, ray_address, ray_workers, ray_cpus, quiet, as_json):
    """Answer --instruction about every document of --docs into --out, one JSON line per document.

    The model is loaded once; its KV cache (--max-cache cells, default the model's context) is shared
    by the documents: each is prefilled and compressed with --policy into its own sequence, and all held
    documents decode together, as many as the cache holds (with room for --max-tokens each) or --parallel.
    A document longer than the model's context less --max-tokens is read in chunks (--chunk). A document
    that fails gets a line with its error and the batch goes on; an interrupted batch keeps every line
    written, and a re-run with the same --out does only the rest. stdout: nothing, or a summary with --json.

    Several questions (--instruction, --question, --questions FILE) are asked of every document: one
    line per document and question (with its "question"), each document read once for all of them
    (its full cache stored and re-selected for each question, as kvcli run does with several).
    --manifest FILE.jsonl gives each document its own questions instead of --docs.
    """
    if bool(docs) == bool(manifest):
        raise KvcliError("give the documents with --docs, or with their questions in --manifest FILE.jsonl")
    questions_for = read_manifest(manifest) if manifest else {}
    if instruction is None and not question_opts and not questions_file and not manifest:
        raise KvcliError("no instruction: give --instruction TEXT, --question TEXT or --questions FILE")
    if instruction is not None and not instruction.strip():
        raise KvcliError("the instruction is empty")
    questions = [] if manifest and instruction is None and not question_opts and not questions_file else \
        list(dict.fromkeys(gather_questions(instruction, question_opts, questions_file)))   # each once
    if (ray_workers or ray_cpus) and not ray_address:
        raise KvcliError("--ray-workers / --ray-cpus set up Ray workers: give --ray ADDRESS too")
    if ray_address:
        import_ray()   # before any document is read: a missing extra is one line
    several = len(questions) > 1 or bool(manifest)
    settings = Settings(instruction="" if several else questions[0], questions=questions if several else [],
                        per_document=bool(manifest),
                        model=model or config.get("model"), policy=req.policy,
                        budget=req.budget, policy_args=req.policy_args, max_tokens=req.max_tokens,
                        sampling=req.sampling, system=system, cache_type=req.cache_type, chunk=req.chunk,
                        chunk_scoring=req.chunk_scoring, max_cache=req.max_cache, parallel=parallel,
                        threads=req.threads)
    paths = list(questions_for) if manifest else list_documents(docs)
    log = (lambda msg: None) if quiet else (lambda msg: click.echo(msg, err=True))
    batch = Batch(settings, paths, progress=not quiet and sys.stderr.isatty(),   # checks the model and policy
                  questions_for=questions_for)
    try:
        batch.results = ResultsFile(out_path, retry_errors=retry_errors, warn=log)   # only then --out is touched
        try:
            if ray_address:
                    batch.ray_workers = batch_ray.run(batch, ray_address, cpus=ray_cpus, workers=ray_workers, log=log)
            else:
                batch.run_local()
        finally:
            batch.results.close()
    finally:
        batch.close()
    s = batch.summary()
    if as_json:
        click.echo(json.dumps(s, ensure_ascii=False))
    elif not quiet:
        label = f"{req.policy}{'' if settings.budget is None else f' @ {settings.budget}'}"
        per = f" ({s['questions']} questions, {s['document_reads']} document reads)" if several else ""
        click.echo(f"[{label}] {s['documents']} documents{per}: {s['answered']} answered, {s['errors']} errors, "
                   f"{s['skipped']} already in {out_path}; {s['prompt_tokens']} prompt + {s['generated_tokens']} "
                   f"answer tokens in {s['elapsed_s']:.1f}s", err=True)


COMMANDS = [batch_cmd]
