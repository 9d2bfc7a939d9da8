"""kvcli documents: the stored documents (re-selection's document caches on disk, kvcli/document_store.py)."""
from __future__ import annotations

import json
import time

import click

from kvcli import document_store


@click.group("documents")
def documents_cmd():
    """Stored documents: the full caches re-selection keeps on disk (kvcli chat, run with several questions,
    batch, compress --store). Each is kept (a --store PATH you named), temporary (in use by a running
    kvcli, removed when it ends), cached, or partial (a read whose process was killed). Cached and partial
    ones expire after a day unused (KVCLI_STORE_EXPIRY_HOURS); past KVCLI_STORE_MAX_BYTES (default 10 GiB)
    the least recently used not in use are removed. docs/terminal.md, "Stored documents"."""


def _size(n: int) -> str:
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} B"


def _ago(t: float) -> str:
    s = max(0.0, time.time() - t)
    for unit, div in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= div:
            return f"{s / div:.0f}{unit} ago"
    return f"{s:.0f}s ago"


@documents_cmd.command("list")
@click.option("--json", "as_json", is_flag=True, help="A JSON array, one object per stored document (id, path, "
              "bytes, state, model, tokens, last_used, ...).")
def list_cmd(as_json):
    """List the stored documents (least recently used first)."""
    items = document_store.entries()
    if as_json:
        click.echo(json.dumps([i.as_json() for i in items], ensure_ascii=False, indent=1))
        return
    if not items:
        click.echo(f"no stored documents in {document_store.root()}")
        return
    rows = [("ID", "STATE", "FORM", "MODEL", "TOKENS", "SIZE", "LAST USED", "PATH")]
    for i in items:
        j = i.as_json()
        state = i.state + (" (in use)" if i.in_use and i.state != "unknown" else "")
        if i.state == "partial" and j["chunks_done"] is not None:
            state += f", {j['chunks_done']} chunks"
        rows.append((i.id, state, j["form"] or "-", j["model"] or "-", str(j["tokens"] or "-"), _size(i.bytes),
                     _ago(i.last_used) if i.last_used else "-", j["path"]))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    for r in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1])
    total = sum(i.store_bytes for i in items)
    click.echo(f"{len(items)} stored document(s); {_size(total)} in {document_store.root()} (cap "
               f"{_size(document_store.max_bytes())})", err=True)


@documents_cmd.command("rm")
@click.argument("ids", nargs=-1, required=True, metavar="ID...")
def rm_cmd(ids):
    """Remove stored documents by id (a unique prefix will do), a kept store's files included."""
    for ident in ids:
        info = document_store.remove(ident)
        click.echo(f"removed {info.id} ({_size(info.bytes)}, {info.record.get('path') or info.folder})", err=True)


@documents_cmd.command("prune")
@click.option("--older-than", "older_than", metavar="D", default=None,
              help="Also remove every stored document (kept ones too) unused for D: 90s, 30m, 12h, 2d, 1w.")
@click.option("--all", "everything", is_flag=True, help="Remove every stored document not in use, kept ones too.")
def prune_cmd(older_than, everything):
    """Remove expired stored documents, and what killed processes left (done anyway by every kvcli that opens the
    store); with --older-than or --all, more."""
    seconds = document_store.parse_duration(older_than) if older_than is not None else None
    removed, busy = document_store.prune(older_than=seconds, everything=everything)
    click.echo(f"removed {len(removed)} stored document(s), {_size(sum(i.bytes for i in removed))}"
               + (f"; {len(busy)} in use by a running kvcli left: {', '.join(i.id for i in busy)}" if busy else ""),
               err=True)


@documents_cmd.command("path")
def path_cmd():
    """Print the store's folder ($KVCLI_CACHE/documents)."""
    click.echo(str(document_store.root()))


COMMANDS = [documents_cmd]
