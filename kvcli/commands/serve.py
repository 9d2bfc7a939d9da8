"""kvcli serve: an OpenAI-compatible local server that reads a document once and answers every request from a cache
re-selected for it (kvcli/apps/serve.py, kvcli/apps/serve_http.py; docs/serve.md)."""
from __future__ import annotations

import os
import re
import socket
from pathlib import Path

import click

from kvcli import config
from kvcli import policies
from kvcli.commands.options import Request, model_option, request_options
from kvcli.errors import KvcliError
from kvcli.models import resolve_model

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.I)


def parse_size(text: str, flag: str) -> int:
    """'2G', '512M', '1000000' -> bytes (powers of 1024)."""
    m = _SIZE.match(str(text))
    if not m:
        raise KvcliError(f"{flag} expects a size such as 2G, 512M or a number of bytes, got '{text}'")
    return int(float(m[1]) * 1024 ** " kmgt".index((m[2] or " ").lower()))


@click.command("serve")
@model_option
@request_options("policy", "sampling", "cache_type", "threads", max_tokens=512,
                 max_tokens_help="Longest answer, in tokens, when a request gives no max_tokens.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface; then set --api-key).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port to listen on.")
@click.option("--api-key", default=lambda: os.environ.get("KVCLI_API_KEY"), metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on /v1/* (401 otherwise). Default: $KVCLI_API_KEY, else none.")
@click.option("--ctx", type=click.IntRange(64, 1 << 20), default=None, metavar="CELLS",
              help="KV cache cells: the longest prompt held whole before it is compressed, plus its answer. A longer "
                   "prompt is read in bounded chunks (budget + chunk cells at most) with a window policy, and gets 400 "
                   "'prompt too long' with full or a column-sum policy. Default: the model's training context, at "
                   "most 16384.")
@click.option("--store", "store_kind", type=click.Choice(["disk", "memory"]), default="disk", show_default=True,
              help="Where stored document caches live: disk, as entries of kvcli's document store (kvcli documents "
                   "list shows them; they outlive the server, and a restarted server restores from them), a working "
                   "set of them in memory too; memory: in memory only, gone when the server stops.")
@click.option("--store-max-bytes", default="2G", show_default=True, metavar="SIZE",
              help="Cap of the stored document caches (each prompt's full cache, kept for the requests that start "
                   "with it), least recently used evicted above it, in memory and on disk (with --store disk it "
                   "overrides the document store's cap while the server runs).")
@click.option("--window-from", type=click.Choice(["question", "policy"]), default="question", show_default=True,
              help="What scores a window policy's selection over a stored document: the question's own tokens (at "
                   "most the policy's window; nothing stored is prefilled again), or the policy's whole window "
                   "(the document's last tokens prefilled again with each question). The request that reads a "
                   "document uses the policy's window, as kvcli run does. A request may say "
                   "\"kvcli\": {\"window_from\": ...}.")
@click.option("--max-body-bytes", default="16M", show_default=True, metavar="SIZE",
              help="Largest request body (413 above it).")
@click.option("--parallel", type=click.IntRange(1, 64), default=4, show_default=True, metavar="N",
              help="Requests decoded together, each from its own compressed cache (llama-server's -np): the others "
                   "wait in a queue, as do those whose prompt, selection and answer do not fit the context beside "
                   "the ones decoding. 1: one request at a time.")
def serve_cmd(req: Request, model, host, port, api_key, ctx, store_kind, store_max_bytes, window_from,
              max_body_bytes, parallel):
    """Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, /v1/models, /health), every answer
    given from a KV cache compressed by --policy to --budget for that request.

    A document is read once: the first request that brings it is prefilled and its full cache stored; a
    later request whose prompt starts with it (another question, another conversation, another client) restores
    that cache up to the longest common prefix and prefills only the rest, with the policy's observation, then the
    cache is compressed for this request's question and the answer decoded from it. A request may choose its own
    compression in the body: "kvcli": {"policy": "snapkv", "budget": 256, "policy_args": {"window": 32}};
    "policy": "full" answers from the whole cache. A prompt past --ctx is read in bounded chunks, as kvcli chat
    reads a long document, and each later question re-selected from the stored chunks. Up to --parallel requests
    decode together in one batch per token, each from its own selection with its own sampling; the others wait their
    turn, in order.

    Listens on 127.0.0.1 unless --host says otherwise. Ctrl-C stops it.
    """
    from kvcli.apps.serve import Choice, DiskStore, Engine, MemoryStore  # noqa: PLC0415 (starlette: this command)
    from kvcli.apps.serve_http import Server, create_app  # noqa: PLC0415
    import uvicorn  # noqa: PLC0415

    store_bytes = parse_size(store_max_bytes, "--store-max-bytes")
    body_bytes = parse_size(max_body_bytes, "--max-body-bytes")
    if req.policy != "full" and req.budget is None:
        raise KvcliError(policies.budget_needed(req.policy))
    _check_address(host, port)   # before the model loads: a port in use is one line, at once
    name = model or config.get("model")
    path = resolve_model(name)
    model_id = name if name and not str(name).lower().endswith(".gguf") else path.stem
    defaults = Choice(policy=req.policy, budget=req.budget, policy_args=dict(req.policy_args),
                      max_tokens=req.max_tokens, sampling=req.sampling, window_from=window_from)
    engine = Engine(path, model_id=model_id, n_ctx=ctx, cache_type=req.cache_type,
                    threads=req.threads, defaults=defaults, parallel=parallel,
                    store=DiskStore(store_bytes) if store_kind == "disk" else MemoryStore(store_bytes))
    try:
        server = Server(engine, api_key=api_key or None, max_body_bytes=body_bytes,
                        aliases=(path.name, path.stem))
        label = req.policy if req.budget is None else f"{req.policy} @ {req.budget}"
        click.echo(f"kvcli serve: {model_id} ({Path(path).name}), {label}, context {engine.n_ctx} cells, "
                   f"{engine.parallel} request{'s' if engine.parallel > 1 else ''} decoded together, "
                   f"http://{host}:{port}/v1" + (" (API key required)" if api_key else ""), err=True)
        if store_kind == "disk":
            from kvcli import document_store  # noqa: PLC0415
            click.echo(f"kvcli serve: stores in {document_store.root()} ({len(engine.store.disk)} of this model "
                       f"there), capped at {store_bytes / 2**20:.0f} MiB", err=True)
        uvicorn.run(create_app(server), host=host, port=port, log_level="warning", access_log=False,
                    timeout_graceful_shutdown=2)
    finally:
        engine.close()


def _check_address(host: str, port: int) -> None:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise KvcliError(f"--host {host}: {e.strerror}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds: a port in TIME_WAIT is free
        try:
            s.bind(addr)
        except OSError as e:
            raise KvcliError(f"cannot listen on {host}:{port}: {e.strerror}") from None


COMMANDS = [serve_cmd]
