"""kvcli run: one document + one instruction -> one answer on stdout."""
from __future__ import annotations

import json
import os
import sys

import click

from kvcli.commands.options import json_option, model_option
from kvcli.errors import KvcliError


def parse_policy_args(items: tuple[str, ...]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise KvcliError(f"--policy-arg expects key=value, got '{item}'")
        out[key.strip()] = value.strip()
    return out


def open_session(engine: str, model: str | None, **kw):
    from kvcli.models import resolve_model  # noqa: PLC0415
    path = resolve_model(model)
    if engine == "native":
        from kvcli.native.session import NativeSession  # noqa: PLC0415
        return NativeSession(path, **kw)
    if engine == "reference":
        from kvcli.reference.session import ReferenceSession  # noqa: PLC0415
        return ReferenceSession(path, **{k: v for k, v in kw.items() if k in ("n_ctx",)})
    raise KvcliError(f"unknown engine '{engine}'")


def write_atomic(path: str, text: str) -> None:
    """Write through a temporary file and rename, so an interruption never leaves half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


@click.command("run")
@click.argument("instruction")
@click.option("--doc", "docs", multiple=True, metavar="FILE",
              help="Document(s) to read ('-' for stdin; several are joined with their names). Default: stdin.")
@model_option
@click.option("--policy", "-p", default=lambda: os.environ.get("KVCLI_POLICY", "full"), show_default="full",
              help="KV-cache policy (kvcli policies lists them).")
@click.option("--budget", "-b", type=int, default=lambda: int(os.environ["KVCLI_BUDGET"])
              if os.environ.get("KVCLI_BUDGET") else None,
              help="Entries kept per layer and KV head, observation window included.")
@click.option("--policy-arg", "policy_args", multiple=True, metavar="KEY=VALUE", help="Policy parameter (repeatable).")
@click.option("--max-tokens", "-n", type=click.IntRange(1, 100000), default=256, show_default=True)
@click.option("--temperature", "-t", type=click.FloatRange(0, 10), default=0.0, show_default=True,
              help="0 = greedy.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--system", default=None, help="System message.")
@click.option("--engine", type=click.Choice(["native", "reference"]), default="native", show_default=True)
@click.option("--cache-type", type=click.Choice(["f16", "q8_0", "q4_0", "f32"]), default="f16", show_default=True,
              help="llama.cpp KV cache type (native engine).")
@click.option("--out", "-o", "out_path", default=None, metavar="FILE", help="Also write the answer to FILE (atomically).")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary on stderr.")
@json_option
def run_cmd(instruction, docs, model, policy, budget, policy_args, max_tokens, temperature, seed, system, engine,
            cache_type, out_path, quiet, as_json):
    """Answer INSTRUCTION about a document, with the KV cache compressed by --policy."""
    from kvcli.documents import read_documents  # noqa: PLC0415
    from kvcli.generate import Sampler  # noqa: PLC0415
    from kvcli.pipeline import run_document  # noqa: PLC0415

    if not instruction.strip():
        raise KvcliError("the instruction is empty")
    document = read_documents(list(docs))
    args = parse_policy_args(policy_args)
    session = open_session(engine, model, n_ctx=0, cache_type=cache_type) if engine == "native" \
        else open_session(engine, model)
    stream = None if as_json else (lambda piece: (sys.stdout.write(piece), sys.stdout.flush()))
    result = run_document(session, document, instruction, policy=policy, budget=budget, policy_args=args,
                          max_tokens=max_tokens, sampler=Sampler(temperature=temperature, seed=seed), system=system,
                          on_text=stream, show_progress=not quiet and sys.stderr.isatty())
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
        click.echo(f"[{result.policy}{'' if result.budget is None else f' @ {result.budget}'}] "
                   f"{s['prompt_tokens']} prompt tokens -> {kept}; prefill {s['prefill_s']:.2f}s, "
                   f"compress {s['compress_s']:.2f}s, {s['generated_tokens']} tokens at "
                   f"{s['decode_tok_s'] or 0:.1f} tok/s" + (f"; {s['note']}" if s.get("note") else ""), err=True)
    if result.stopped == "interrupted":
        raise KeyboardInterrupt
    if result.stopped == "context_full":
        click.echo("kvcli: the context filled up before the answer ended", err=True)


COMMANDS = [run_cmd]
