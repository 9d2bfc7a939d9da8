"""Reading the user's documents: text only, with an exact one-line reason when it is not."""
from __future__ import annotations

import sys
from pathlib import Path

from kvcli.errors import KvcliError

MAX_DOCUMENT_MB = 64   # each document is read up to this size (docs/usage.md): an endless stream is refused
_BLOCK = 1 << 20


def decode_text(data: bytes, name: str) -> str:
    if not data.strip():
        raise KvcliError(f"{name} is empty")
    if b"\x00" in data[:65536]:
        raise KvcliError(f"{name} is not a text file (it contains NUL bytes)")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise KvcliError(f"{name} is not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} "
                         f"(line {line}, column {col})") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    # other control characters than whitespace mean a binary file that happens to decode
    controls = sum(1 for ch in text[:65536] if ord(ch) < 32 and ch not in "\n\r\t\f\v")
    if controls > max(8, len(text[:65536]) // 100):
        raise KvcliError(f"{name} is not a text file (it contains binary control bytes)")
    return text


def read_document(path: str) -> str:
    """Read one --doc argument; '-' is standard input."""
    if path == "-":
        return read_stdin()
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
    return decode_text(data, path)


def read_bounded(f, name: str) -> bytes:
    """Read a file or stream up to MAX_DOCUMENT_MB, refusing more (/dev/zero, `yes |`) and a binary start early."""
    data = bytearray()
    while True:
        block = f.read(_BLOCK)
        if not block:
            return bytes(data)
        if not data and b"\x00" in block[:65536]:
            raise KvcliError(f"{name} is not a text file (it contains NUL bytes)")
        data += block
        if len(data) > MAX_DOCUMENT_MB << 20:
            raise KvcliError(f"{name} is larger than {MAX_DOCUMENT_MB} MB, the most kvcli reads as a document")


def read_stdin() -> str:
    if sys.stdin is None or sys.stdin.isatty():
        raise KvcliError("no document: pass --doc FILE or pipe text on standard input")
    return decode_text(read_bounded(sys.stdin.buffer, "standard input"), "standard input")


def read_documents(paths: tuple[str, ...] | list[str]) -> str:
    """One document, or several joined with their names as headers."""
    if not paths:
        return read_stdin()
    if len(paths) == 1:
        return read_document(paths[0])
    parts = [f"### {('standard input' if p == '-' else Path(p).name)}\n\n{read_document(p).strip()}" for p in paths]
    return "\n\n".join(parts)
