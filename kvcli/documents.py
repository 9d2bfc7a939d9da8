"""Reading the user's documents: plain text, Markdown, HTML, PDF, EPUB and DOCX (kvcli/doc_formats.py converts them),
with an exact one-line reason when one cannot be read.

`open_document(path)` / `open_documents(paths)` give a `Document` (the text and where its pages, chapters and
sections begin); `read_document` / `read_documents` give its text. A converted document (PDF, EPUB, DOCX, HTML) is
cached by the SHA-256 of its bytes in the document store's folder (`<store>/converted/<sha256>.json`, at most
CACHE_MAX_BYTES, least recently used out first), so a second question about the same file does not convert it again.
Nothing is written for a document that cannot be read.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

from kvcli.doc_formats import CONVERTED, SUFFIXES, Boundary, Document, convert, decode_text, detect, sniff
from kvcli.errors import KvcliError

__all__ = ["Boundary", "Document", "decode_text", "open_document", "open_documents", "read_document",
           "read_documents", "read_bounded", "read_stdin", "convert_bytes", "MAX_DOCUMENT_MB", "MAX_BINARY_MB"]

MAX_DOCUMENT_MB = 64    # a text document is read up to this size (docs/usage.md): an endless stream is refused
MAX_BINARY_MB = 512     # a PDF, EPUB or DOCX (their images make them large; their text is a small part)
CACHE_FORMAT = 1        # raised when a converter changes what it makes: older cached conversions are not used
CACHE_MAX_BYTES = 256 << 20
_BLOCK = 1 << 20
_BINARY_FORMATS = ("pdf", "epub", "docx")


def read_bounded(f, name: str) -> bytes:
    """Read a file or stream up to MAX_DOCUMENT_MB (MAX_BINARY_MB for a PDF, EPUB or DOCX), refusing more
    (/dev/zero, `yes |`), and a binary file of a type kvcli does not read at its first block."""
    data = bytearray()
    limit = MAX_DOCUMENT_MB
    while True:
        block = f.read(_BLOCK)
        if not block:
            return bytes(data)
        if not data:
            if SUFFIXES.get(Path(name).suffix.lower()) in _BINARY_FORMATS or block.startswith(b"PK\x03\x04") \
                    or b"%PDF-" in block[:1024]:
                limit = MAX_BINARY_MB
            elif b"\x00" in block[:65536]:
                what = sniff(block) or "it contains NUL bytes"
                raise KvcliError(f"{name} is not a text file nor a document kvcli reads ({what}): it reads "
                                 ".pdf, .epub, .docx, .html/.htm, .md and plain text")
        data += block
        if len(data) > limit << 20:
            raise KvcliError(f"{name} is larger than {limit} MB, the most kvcli reads as a document")


def convert_bytes(data: bytes, name: str) -> Document:
    """A document's bytes as a Document; a converted format through the cache (keyed by the bytes' SHA-256)."""
    fmt = detect(data, name)
    if fmt not in CONVERTED:
        return convert(data, name, fmt)
    sha = hashlib.sha256(data).hexdigest()
    doc = _cache_get(sha, name)
    if doc is None:
        doc = convert(data, name, fmt)
        _cache_put(sha, doc)
    if doc.warnings:   # said again when the conversion comes from the cache
        print(f"kvcli: warning: {name}: {', '.join(doc.warnings)}", file=sys.stderr, flush=True)
    return doc


def open_document(path: str) -> Document:
    """Read one --doc argument; '-' is standard input."""
    if path == "-":
        return _stdin()
    p = Path(path).expanduser()
    if not p.exists():
        raise KvcliError(f"document not found: {path}")
    if p.is_dir():
        raise KvcliError(f"{path} is a directory, not a document")
    try:
        with open(p, "rb") as f:
            data = read_bounded(f, path)
    except OSError as e:
        raise KvcliError(f"cannot read {path}: {e.strerror}") from None
    return convert_bytes(data, path)


def read_document(path: str) -> str:
    return open_document(path).text


def _stdin() -> Document:
    if sys.stdin is None or sys.stdin.isatty():
        raise KvcliError("no document: pass --doc FILE or pipe text on standard input")
    return convert_bytes(read_bounded(sys.stdin.buffer, "standard input"), "standard input")


def read_stdin() -> str:
    return _stdin().text


def open_documents(paths: tuple[str, ...] | list[str]) -> Document:
    """One document, or several joined with their names as headers (each a "document" boundary)."""
    if not paths:
        return _stdin()
    if len(paths) == 1:
        return open_document(paths[0])
    parts, marks, n = [], [], 0
    for p in paths:
        doc = open_document(p)
        name = "standard input" if p == "-" else Path(p).name
        head = f"### {name}\n\n"
        body = doc.text.strip()
        lead = len(doc.text) - len(doc.text.lstrip())
        if parts:
            parts.append("\n\n")
            n += 2
        marks.append(Boundary("document", name, n))
        marks += [Boundary(b.kind, b.label, n + len(head) + max(0, b.start - lead), b.level) for b in doc.boundaries
                  if b.start - lead < len(body)]
        parts.append(head + body)
        n += len(head) + len(body)
    return Document("".join(parts), "joined", ", ".join(paths), marks)


def read_documents(paths: tuple[str, ...] | list[str]) -> str:
    """One document, or several joined with their names as headers."""
    return open_documents(paths).text


# ------------------------------------------------------------------------------------------ the conversion cache
def cache_dir() -> Path:
    from kvcli.document_store import CONVERTED as FOLDER, root   # noqa: PLC0415 (only a converted document needs it)
    return root() / FOLDER


def _cache_get(sha: str, name: str) -> Document | None:
    try:
        p = cache_dir() / f"{sha}.json"
        rec = json.loads(p.read_text(encoding="utf-8"))
        if rec.get("cache_format") != CACHE_FORMAT:
            return None
        doc = Document.from_json(rec, name)
        os.utime(p)   # last used: the cap removes the least recently used first
        return doc
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _cache_put(sha: str, doc: Document) -> None:
    """Write a conversion (atomically: a reader sees the whole file or none), then hold the cache to its cap. A cache
    that cannot be written (a read-only home) is no error: the next question converts again."""
    try:
        d = cache_dir()
        d.mkdir(exist_ok=True)
        tmp = d / f".{sha}.{os.getpid()}.tmp"
        rec = {"cache_format": CACHE_FORMAT, "sha256": sha, **doc.as_json()}
        tmp.write_text(json.dumps(rec, ensure_ascii=False), encoding="utf-8")
        os.replace(tmp, d / f"{sha}.json")
        _trim(d)
    except OSError:
        pass


def _trim(d: Path) -> None:
    files = []
    for p in d.iterdir():
        try:
            st = p.stat()
        except OSError:
            continue
        if p.name.endswith(".tmp"):   # a write that died (its pid is gone) left it
            if not _alive_tmp(p):
                p.unlink(missing_ok=True)
            continue
        files.append((st.st_mtime, st.st_size, p))
    total = sum(s for _, s, _ in files)
    for _, size, p in sorted(files, key=lambda x: x[0]):
        if total <= CACHE_MAX_BYTES:
            break
        p.unlink(missing_ok=True)
        total -= size


def _alive_tmp(p: Path) -> bool:
    """A temporary conversion file whose writer lives (its pid is in the name)."""
    try:
        pid = int(p.name.split(".")[-2])
        os.kill(pid, 0)
        return True
    except (ValueError, IndexError, ProcessLookupError):
        return False
    except PermissionError:
        return True
