"""The document formats kvcli reads: PDF, EPUB, DOCX, HTML, Markdown and plain text, each converted to text with the
boundaries of its pages, chapters and sections kept as character offsets into that text (`Boundary`), so that a
passage can be named as "page 3" or "section 2.1".

Libraries (docs/usage.md, "Document formats", gives the choice and the measured sizes): pypdf for PDF, python-docx
for DOCX, the standard library for the rest (zipfile + xml.etree for an EPUB's package, html.parser for its chapters
and for HTML). pypdf and python-docx are imported only when a document of their format is read.

Every refusal is one line (KvcliError, exit 2): a scanned PDF (no text layer: how many pages), an encrypted PDF, a
damaged file of any format, a binary file of a type kvcli does not read, an empty document.

A huge document says its token count and how long its read will take before the read starts (`announce_read`, one
line on stderr, in kvcli run, chat and compress, whatever the form of the read): the time estimated from a
configured speed (KVCLI_READ_TOK_S), else the speed the last read of the same form measured on this machine
(recorded per model, form, cache type and threads in $KVCLI_CACHE/read-speeds.json, `record_read_speed`), else a
prefill of the document's first PROBE_TOKENS tokens timed just before (`probe_speed`: for a document of PROBE_FROM
tokens or more).
"""
from __future__ import annotations

import codecs
import io
import json
import logging
import math
import os
import posixpath
import re
import sys
import time
import zipfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote
from xml.etree import ElementTree as ET

from kvcli.errors import KvcliError

READS = ".pdf, .epub, .docx, .html/.htm, .md and plain text"
SUFFIXES = {".pdf": "pdf", ".epub": "epub", ".docx": "docx", ".html": "html", ".htm": "html", ".xhtml": "html",
            ".md": "markdown", ".markdown": "markdown", ".txt": "text", ".text": "text"}
CONVERTED = ("pdf", "epub", "docx", "html")   # the formats whose conversion is worth caching (documents.py)
_TEXT_PROBE = 65536
_HTML_START = re.compile(rb"(\xef\xbb\xbf)?\s*(<\?xml[^>]*>\s*)?(<!--.*?-->\s*)*(<!doctype\s+html|<html[\s>])",
                         re.I | re.S)   # an HTML page's start (standard input, a file without a suffix)

# the start of a file that is none of the formats kvcli reads, and what to call it in the error
_BINARY = ((b"\x89PNG", "a PNG image"), (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
           (b"\x1f\x8b", "a gzip archive"), (b"BZh", "a bzip2 archive"), (b"\xfd7zXZ", "an xz archive"),
           (b"7z\xbc\xaf", "a 7z archive"), (b"Rar!", "a RAR archive"), (b"\x7fELF", "a program (ELF)"),
           (b"\xd0\xcf\x11\xe0", "an old-format or password-protected Office file (save it as .docx)"),
           (b"PK\x03\x04", "a ZIP archive"), (b"GGUF", "a GGUF model"), (b"OggS", "an Ogg file"),
           (b"ID3", "an MP3 file"), (b"RIFF", "a RIFF (WAV/AVI/WebP) file"))


@dataclass(frozen=True)
class Boundary:
    """Where a page, chapter or section begins in a converted document's text."""

    kind: str       # "page", "chapter", "section", or "document" (one of several --doc joined)
    label: str      # the page's label ("3", or "iii" where the PDF names its pages), the heading's text, the file name
    start: int      # character offset in Document.text
    level: int = 1  # a section's heading level (1: h1, "Heading 1", "#", a PDF outline's top level)


@dataclass
class Document:
    """A document as text, with its boundaries (in order of `start`)."""

    text: str
    format: str                     # "pdf", "epub", "docx", "html", "markdown", "text"
    name: str = ""
    boundaries: list[Boundary] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)   # what was read only in part (documents.py prints them)

    def of_kind(self, kind: str) -> list[Boundary]:
        return [b for b in self.boundaries if b.kind == kind]

    def where(self, offset: int) -> dict[str, Boundary]:
        """The page, chapter, section and document that the character at `offset` lies in (the kinds it has)."""
        out: dict[str, Boundary] = {}
        for b in self.boundaries:
            if b.start <= offset:
                out[b.kind] = b
        return out

    def as_json(self) -> dict:
        return {"format": self.format, "text": self.text, "warnings": self.warnings,
                "boundaries": [[b.kind, b.label, b.start, b.level] for b in self.boundaries]}

    @classmethod
    def from_json(cls, d: dict, name: str = "") -> Document:
        return cls(d["text"], d["format"], name, [Boundary(k, lb, int(s), int(lv)) for k, lb, s, lv in d["boundaries"]],
                   [str(w) for w in d.get("warnings", [])])


# ------------------------------------------------------------------------------------------ which format
def detect(data: bytes, name: str) -> str:
    """The format of a document: its suffix says, but a PDF, EPUB or DOCX is known by its content too (standard
    input, a file without a suffix or misnamed); a binary file of another type is refused here."""
    suffix = Path(name).suffix.lower() if name != "standard input" else ""
    fmt = SUFFIXES.get(suffix)
    if fmt in ("pdf", "epub", "docx"):
        return fmt
    sniffed = sniff(data)
    if sniffed in ("pdf", "epub", "docx"):
        return sniffed
    if sniffed:
        raise KvcliError(f"{name} is not a text file nor a document kvcli reads ({sniffed}): it reads {READS}")
    if fmt is None and _HTML_START.match(data[:4096]):
        return "html"
    return fmt or "text"


def sniff(data: bytes) -> str | None:
    """'pdf', 'epub' or 'docx' from a file's content, a binary type's name ('a PNG image') or None (text, maybe)."""
    if b"%PDF-" in data[:1024]:
        return "pdf"
    if data.startswith(b"PK\x03\x04"):
        try:
            names = set(zipfile.ZipFile(io.BytesIO(data)).namelist())
        except (zipfile.BadZipFile, OSError, ValueError):
            names = set()
        if "META-INF/container.xml" in names or data[30:58] == b"mimetypeapplication/epub+zip":
            return "epub"
        if "word/document.xml" in names:
            return "docx"
    if not _binaryish(data):
        return None
    for magic, what in _BINARY:
        if data.startswith(magic):
            return what
    return "it contains NUL bytes" if b"\x00" in data[:_TEXT_PROBE] else None


def _binaryish(data: bytes) -> bool:
    """NUL bytes, or not UTF-8 in its first 4 KB (a text file may start as a binary type's magic does)."""
    if b"\x00" in data[:_TEXT_PROBE]:
        return True
    try:
        data[:4096].decode("utf-8")
    except UnicodeDecodeError as e:
        return e.start < min(len(data), 4096) - 3
    return False


def convert(data: bytes, name: str, fmt: str | None = None) -> Document:
    """`data` as a Document of its format (`detect` unless given); a document with no text is refused."""
    fmt = fmt or detect(data, name)
    doc = {"pdf": pdf, "epub": epub, "docx": docx, "html": html, "markdown": markdown, "text": text}[fmt](data, name)
    doc.name = name
    if not doc.text.strip():
        what = {"pdf": "a PDF", "epub": "an EPUB", "docx": "a DOCX", "html": "an HTML page"}.get(fmt)
        raise KvcliError(f"{name} is empty" + (f" ({what} with no text)" if what else ""))
    return doc


def _why(e: BaseException) -> str:
    s = " ".join(str(e).split())
    return (s[:150] + "...") if len(s) > 150 else (s or type(e).__name__)


# ------------------------------------------------------------------------------------------ plain text, Markdown
def decode_text(data: bytes, name: str) -> str:
    if not data.strip():
        raise KvcliError(f"{name} is empty")
    if b"\x00" in data[:_TEXT_PROBE]:
        raise KvcliError(f"{name} is not a text file (it contains NUL bytes)")
    try:
        out = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        col = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise KvcliError(f"{name} is not valid UTF-8: byte 0x{data[e.start]:02x} at offset {e.start} "
                         f"(line {line}, column {col})") from None
    if out.startswith("\ufeff"):
        out = out[1:]
    # other control characters than whitespace mean a binary file that happens to decode
    controls = sum(1 for ch in out[:_TEXT_PROBE] if ord(ch) < 32 and ch not in "\n\r\t\f\v")
    if controls > max(8, len(out[:_TEXT_PROBE]) // 100):
        raise KvcliError(f"{name} is not a text file (it contains binary control bytes)")
    return out


def text(data: bytes, name: str) -> Document:
    """Plain text as it is; form feeds (as pdftotext writes between pages) are page boundaries."""
    t = decode_text(data, name)
    pages = []
    if "\f" in t:
        starts = [0] + [m.end() for m in re.finditer("\f", t)]
        pages = [Boundary("page", str(i + 1), s) for i, s in enumerate(starts)]
    return Document(t, "text", name, pages)


_ATX = re.compile(r" {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*")
_FENCE = re.compile(r" {0,3}(```|~~~)")
_SETEXT = re.compile(r" {0,3}(=+|-+)[ \t]*")


def markdown(data: bytes, name: str) -> Document:
    """Markdown as it is (the model reads its markup well); its headings (# and underlined, outside code blocks) are
    section boundaries."""
    t = decode_text(data, name)
    out, fence, pos, prev = [], None, 0, None   # prev: (start, line) of the previous line when it is paragraph text
    for i, line in enumerate(t.splitlines(keepends=True)):
        body = line.rstrip("\r\n")
        m = _FENCE.match(body)
        if i == 0 and body == "---":
            fence = "front matter"   # YAML front matter (Jekyll, Hugo, Obsidian): its --- is no heading
        elif fence == "front matter":
            if body in ("---", "..."):
                fence = None
        elif fence:
            if m and m[1] == fence:
                fence = None
        elif m:
            fence, prev = m[1], None
        elif h := _ATX.fullmatch(body):
            out.append(Boundary("section", h[2].strip(), pos + body.index(h[1]), len(h[1])))
            prev = None
        elif (s := _SETEXT.fullmatch(body)) and prev is not None:
            out.append(Boundary("section", prev[1].strip(), prev[0], 1 if s[1][0] == "=" else 2))
            prev = None
        else:
            prev = (pos, body) if body.strip() and not body.lstrip().startswith(("-", "*", "+", ">", "|")) else None
        pos += len(line)
    return Document(t, "markdown", name, out)


# ------------------------------------------------------------------------------------------ assembling converted text
class _Parts:
    """Text assembled block by block ("\\n\\n" between blocks), with boundaries at the blocks' starts."""

    def __init__(self):
        self.parts: list[str] = []
        self.n = 0
        self.boundaries: list[Boundary] = []
        self._pending: list[tuple[str, str, int]] = []   # boundaries that begin with the next block

    def mark(self, kind: str, label: str, level: int = 1) -> None:
        self._pending.append((kind, label, level))

    def add(self, block: str, marks: list[Boundary] = ()) -> None:
        """A block of text; `marks` at offsets inside it (a converted chapter's own sections)."""
        lead = len(block) - len(block.lstrip())
        block = block.strip()
        if not block:
            return
        if self.parts:
            self.parts.append("\n\n")
            self.n += 2
        self.boundaries += [Boundary(k, lb, self.n, lv) for k, lb, lv in self._pending]
        self._pending = []
        self.boundaries += [Boundary(b.kind, b.label, self.n + max(0, b.start - lead), b.level) for b in marks
                            if b.start - lead < len(block)]
        self.parts.append(block)
        self.n += len(block)

    def document(self, fmt: str, name: str) -> Document:
        return Document("".join(self.parts), fmt, name, self.boundaries)


# ------------------------------------------------------------------------------------------ PDF
def pdf(data: bytes, name: str) -> Document:
    """Each page's text layer (pypdf), pages joined by a blank line; the page boundaries carry the PDF's page labels
    where it has them, and its outline (bookmarks) gives the sections."""
    try:
        from pypdf import PdfReader   # noqa: PLC0415 (only a PDF needs it)
        from pypdf.errors import DependencyError  # noqa: PLC0415
    except ImportError:
        raise KvcliError(f"reading {name} needs pypdf (pip install pypdf)") from None
    logging.getLogger("pypdf").setLevel(logging.ERROR)   # its warnings on a damaged file: our one line says it
    if b"%PDF-" not in data[:1024]:
        raise KvcliError(f"{name} is not a readable PDF (damaged? it does not start with %PDF-)")
    try:
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted:
            try:
                opened = reader.decrypt("")   # encrypted with an empty user password: readable as it is
            except (DependencyError, NotImplementedError):
                raise KvcliError(f"{name} is an encrypted PDF (AES): reading it needs the cryptography package "
                                 f"(pip install cryptography), or decrypt it first (qpdf --decrypt)") from None
            if not opened:
                raise KvcliError(f"{name} is an encrypted PDF (password-protected): decrypt it first, e.g. "
                                 f"qpdf --decrypt --password=PASSWORD {name} plain.pdf")
        pages, failed = [], 0
        for page in reader.pages:
            try:
                pages.append(page.extract_text() or "")
            except Exception:   # noqa: BLE001 (one damaged page: the others are still read)
                pages.append("")
                failed += 1
        if failed and failed == len(pages):
            raise ValueError(f"none of its {len(pages)} pages could be read")
        try:
            labels = list(reader.page_labels)
        except Exception:   # noqa: BLE001 (a damaged label tree: pages are numbered 1, 2, ...)
            labels = []
        outline = _pdf_outline(reader)
    except KvcliError:
        raise
    except Exception as e:   # noqa: BLE001 (pypdf raises many types on a damaged file)
        raise KvcliError(f"{name} is not a readable PDF (damaged?): {_why(e)}") from None
    if not pages:
        raise KvcliError(f"{name} is empty (a PDF of no pages)")
    if not any(p.strip() for p in pages):
        raise KvcliError(f"{name} has no text layer (a scanned PDF?): none of its {len(pages)} page"
                         f"{'s' if len(pages) != 1 else ''} holds text; run OCR on it first (e.g. ocrmypdf)")
    if len(labels) != len(pages):
        labels = [str(i + 1) for i in range(len(pages))]
    empty = sum(1 for p in pages if not p.strip()) - failed
    warnings = [f"{failed} of {len(pages)} pages could not be read (damaged?)"] if failed else []
    if empty >= 2 and empty * 10 >= len(pages):
        warnings.append(f"{empty} of {len(pages)} pages hold no text (scanned?)")
    parts, starts = [], []
    n = 0
    for page in pages:
        page = "\n".join(line.rstrip() for line in page.strip().splitlines())
        if parts:
            parts.append("\n\n")
            n += 2
        starts.append(n)
        parts.append(page)
        n += len(page)
    t = "".join(parts)
    out = [Boundary("page", labels[i], s) for i, s in enumerate(starts)]
    for title, page, level in outline:
        end = starts[page + 1] if page + 1 < len(starts) else len(t)
        at = t.find(title, starts[page], end)
        out.append(Boundary("section", title, at if at >= 0 else starts[page], level))
    out.sort(key=lambda b: (b.start, b.kind != "page"))
    return Document(t, "pdf", name, out, warnings)


def _pdf_outline(reader) -> list[tuple[str, int, int]]:
    """(title, page index, level) of each outline entry that points at a page."""
    out = []

    def walk(items, level):
        for it in items:
            if isinstance(it, list):
                walk(it, level + 1)
                continue
            try:
                page = reader.get_destination_page_number(it)
            except Exception:   # noqa: BLE001 (an entry pointing nowhere is left out)
                continue
            title = " ".join(str(getattr(it, "title", "") or "").split())
            if title and page is not None and 0 <= page < len(reader.pages):
                out.append((title, page, level))
    try:
        walk(reader.outline, 1)
    except Exception:   # noqa: BLE001 (a damaged outline: no sections, the pages are still read)
        return []
    return out


# ------------------------------------------------------------------------------------------ DOCX
def docx(data: bytes, name: str) -> Document:
    """Paragraphs and tables in document order (python-docx); "Title" and "Heading N" paragraphs are sections, and
    page breaks (the ones Word records where it laid out a page, else hard page breaks) are page boundaries."""
    try:
        import docx as python_docx   # noqa: PLC0415 (only a DOCX needs it)
        from docx.table import Table  # noqa: PLC0415
    except ImportError:
        raise KvcliError(f"reading {name} needs python-docx (pip install python-docx)") from None
    if data.startswith(b"\xd0\xcf\x11\xe0"):
        raise KvcliError(f"{name} is a password-protected or old-format Word file, not a DOCX: save it as .docx "
                         "without a password")
    try:
        d = python_docx.Document(io.BytesIO(data))
        blocks = list(d.iter_inner_content())
        rendered = any(p.rendered_page_breaks for p in d.paragraphs)
        parts, page = _Parts(), 1
        for block in blocks:
            if isinstance(block, Table):
                parts.add("\n".join(" | ".join(c.text.strip() for c in _unique_cells(row)) for row in block.rows))
                continue
            breaks = len(block.rendered_page_breaks) if rendered else \
                len(block._p.xpath("./w:r/w:br[@w:type='page']"))
            for _ in range(breaks):
                page += 1
                parts.mark("page", str(page))
            style = (block.style.name if block.style is not None else "") or ""
            level = 1 if style == "Title" else int(m[1]) if (m := re.fullmatch(r"Heading (\d)", style)) else 0
            if level and block.text.strip():
                parts.mark("section", " ".join(block.text.split()), level)
            parts.add(block.text)
    except Exception as e:   # noqa: BLE001 (a damaged package raises KeyError, XML and zip errors)
        raise KvcliError(f"{name} is not a readable DOCX (damaged?): {_why(e)}") from None
    doc = parts.document("docx", name)
    if page > 1:
        doc.boundaries.insert(0, Boundary("page", "1", 0))
    return doc


def _unique_cells(row):
    """A row's cells, a merged cell once (python-docx repeats it for each grid column it spans)."""
    seen, out = set(), []
    for c in row.cells:
        if id(c._tc) not in seen:
            seen.add(id(c._tc))
            out.append(c)
    return out


# ------------------------------------------------------------------------------------------ HTML
_SKIP = {"script", "style", "noscript", "template", "title", "svg"}
_BLOCK2 = {"p", "pre", "blockquote", "ul", "ol", "dl", "table", "figure", "h1", "h2", "h3", "h4", "h5", "h6", "hr",
           "section", "article", "header", "footer", "main", "aside", "nav", "address", "form", "fieldset"}
_BLOCK1 = {"div", "li", "dt", "dd", "tr", "figcaption", "caption", "br", "body"}


class _HTMLText(HTMLParser):
    """HTML's readable text: blocks on lines of their own, white space collapsed outside <pre>, list items with
    "- ", table cells with " | "; h1-h6 are sections (at the offset of the heading's text)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.n = 0
        self.brk = 0            # newlines owed before the next text
        self.space = False      # a space owed before the next text
        self.sep = ""           # a cell separator owed
        self.skip = 0
        self.pre = 0
        self.heading: list | None = None   # [level, start, [texts]]
        self.boundaries: list[Boundary] = []
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        if tag in _SKIP:
            self._in_title = tag == "title"
            self.skip += 1
            return
        self._block(tag)
        if tag == "pre":
            self.pre += 1
        elif tag == "li":
            self._emit("- ", raw=True)
        elif tag in ("td", "th"):
            if self.sep == "row":
                self.sep = " | "
            elif not self.sep:
                self.sep = "row"
        elif tag == "tr":
            self.sep = ""
        elif len(tag) == 2 and tag[0] == "h" and tag[1] in "123456":
            self.heading = [int(tag[1]), None, []]

    def handle_startendtag(self, tag, attrs):
        self.handle_starttag(tag, attrs)
        if tag in _SKIP:
            self.handle_endtag(tag)

    def handle_endtag(self, tag):
        if tag in _SKIP:
            self.skip = max(0, self.skip - 1)
            self._in_title = False
            return
        self._block(tag)
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        elif self.heading and tag == f"h{self.heading[0]}":
            level, start, texts = self.heading
            label = " ".join("".join(texts).split())
            if start is not None and label:
                self.boundaries.append(Boundary("section", label, start, level))
            self.heading = None

    def _block(self, tag):
        if tag in _BLOCK2:
            self.brk = 2
        elif tag in _BLOCK1:
            self.brk = max(self.brk, 1)

    def handle_data(self, data):
        if self.skip:
            if self._in_title:
                self.title += data
            return
        if self.pre:
            self._emit(data, raw=True)
            return
        words = data.split()
        if words == ["\u00b6"]:   # a heading's permalink sign (Sphinx, many blogs): no text
            return
        if not words:
            self.space = self.space or bool(data)
            return
        if data[0].isspace():
            self.space = True
        self._emit(" ".join(words))
        self.space = data[-1].isspace()

    def _emit(self, s: str, raw: bool = False):
        if not s:
            return
        glue = ""
        if self.parts:
            if self.brk:
                glue = "\n" * self.brk
            elif self.sep not in ("", "row"):
                glue = self.sep
            else:
                glue = " " if self.space and not raw and not self.parts[-1][-1:].isspace() else ""
            self.parts.append(glue)
            self.n += len(glue)
        if self.sep not in ("", "row"):
            self.sep = "row"
        self.brk, self.space = 0, False
        if self.heading is not None:
            if self.heading[1] is None:
                self.heading[1] = self.n
            else:
                self.heading[2].append(glue)
            self.heading[2].append(s)
        self.parts.append(s)
        self.n += len(s)

    def result(self) -> tuple[str, list[Boundary]]:
        t = "".join(self.parts)
        stripped = t.rstrip()
        return stripped, [b for b in self.boundaries if b.start < len(stripped)]


def html_text(markup: str) -> tuple[str, list[Boundary], str]:
    """(text, section boundaries, <title>) of an HTML page."""
    p = _HTMLText()
    p.feed(markup)
    p.close()
    t, marks = p.result()
    return t, marks, " ".join(p.title.split())


def decode_html(data: bytes, name: str) -> str:
    """HTML's bytes as text: UTF-8 (or UTF-16 with its BOM), else the charset its <meta> declares."""
    for bom, enc in ((codecs.BOM_UTF16_LE, "utf-16"), (codecs.BOM_UTF16_BE, "utf-16")):
        if data.startswith(bom):
            return data.decode(enc, errors="replace")
    try:
        return decode_text(data, name)
    except KvcliError:
        m = re.search(rb"""charset\s*=\s*["']?([A-Za-z0-9_.:-]+)""", data[:4096], re.I)
        if m is None or b"\x00" in data[:_TEXT_PROBE]:
            raise
        try:
            return data.decode(m[1].decode("ascii"), errors="replace")
        except LookupError:
            raise KvcliError(f"{name} declares an unknown character set '{m[1].decode('ascii')}'") from None


def html(data: bytes, name: str) -> Document:
    t, marks, _ = html_text(decode_html(data, name))
    return Document(t, "html", name, marks)


# ------------------------------------------------------------------------------------------ EPUB
_CONTAINER = "{urn:oasis:names:tc:opendocument:xmlns:container}"
_OPF = "{http://www.idpf.org/2007/opf}"
_NCX = "{http://www.daisy.org/z3986/2005/ncx/}"
_XHTML = "{http://www.w3.org/1999/xhtml}"
_OPS_TYPE = "{http://www.idpf.org/2007/ops}type"
_XENC = "{http://www.w3.org/2001/04/xmlenc#}"


def epub(data: bytes, name: str) -> Document:
    """The spine's documents in reading order, each a chapter (named by the book's table of contents, else by its
    first heading), their headings sections."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
        container = ET.fromstring(zf.read("META-INF/container.xml"))
        rootfile = container.find(f".//{_CONTAINER}rootfile")
        if rootfile is None:
            raise ValueError("META-INF/container.xml names no package file")
        opf_path = rootfile.get("full-path", "")
        opf = ET.fromstring(zf.read(opf_path))
        base = posixpath.dirname(opf_path)
        manifest = {it.get("id"): (_join(base, it.get("href", "")), it.get("media-type", ""),
                                   it.get("properties", "")) for it in opf.iter(f"{_OPF}item")}
        spine_el = opf.find(f"{_OPF}spine")
        if spine_el is None:
            raise ValueError(f"{opf_path} has no spine")
        spine = [manifest[r.get("idref")] for r in spine_el.iter(f"{_OPF}itemref") if r.get("idref") in manifest]
        _refuse_drm(zf, {path for path, _, _ in spine}, name)
        toc = _epub_toc(zf, manifest, spine_el.get("toc"))
        parts, n = _Parts(), 0
        for path, media, _ in spine:
            if "html" not in media and not path.lower().endswith((".html", ".htm", ".xhtml")):
                continue
            t, marks, title = html_text(_decode_member(zf.read(path), path))
            if not t.strip():
                continue
            n += 1
            first = next((b.label for b in marks if b.kind == "section"), "")
            parts.mark("chapter", toc.get(path) or first or title or f"chapter {n}")
            parts.add(t, marks)
    except KvcliError:
        raise
    except Exception as e:   # noqa: BLE001 (a damaged package: zip, XML, missing members)
        raise KvcliError(f"{name} is not a readable EPUB (damaged?): {_why(e)}") from None
    return parts.document("epub", name)


def _join(base: str, href: str) -> str:
    return posixpath.normpath(posixpath.join(base, unquote(href.split("#")[0]))) if href else ""


def _decode_member(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return decode_html(data, path)


def _refuse_drm(zf: zipfile.ZipFile, spine: set[str], name: str) -> None:
    """An EPUB whose chapters are encrypted (DRM; fonts obfuscated by the publisher are fine) cannot be read."""
    try:
        enc = ET.fromstring(zf.read("META-INF/encryption.xml"))
    except KeyError:
        return
    for ref in enc.iter(f"{_XENC}CipherReference"):
        if posixpath.normpath(unquote(ref.get("URI", ""))) in spine:
            raise KvcliError(f"{name} is an encrypted (DRM-protected) EPUB: kvcli reads only unprotected books")


def _epub_toc(zf: zipfile.ZipFile, manifest: dict, ncx_id: str | None) -> dict[str, str]:
    """A chapter file's title from the EPUB 3 navigation document, else the EPUB 2 NCX (the first entry per file)."""
    out: dict[str, str] = {}
    try:
        nav = next((p for p, _, props in manifest.values() if "nav" in props.split()), None)
        if nav:
            root = ET.fromstring(zf.read(nav))
            for el in root.iter(f"{_XHTML}nav"):
                if el.get(_OPS_TYPE) == "toc":
                    for a in el.iter(f"{_XHTML}a"):
                        label = " ".join("".join(a.itertext()).split())
                        out.setdefault(_join(posixpath.dirname(nav), a.get("href", "")), label)
        ncx = manifest.get(ncx_id, (None,))[0] or next(
            (p for p, m, _ in manifest.values() if m.endswith("x-dtbncx+xml")), None)
        if not out and ncx:
            root = ET.fromstring(zf.read(ncx))
            for point in root.iter(f"{_NCX}navPoint"):
                label = point.find(f"{_NCX}navLabel/{_NCX}text")
                content = point.find(f"{_NCX}content")
                if label is not None and content is not None:
                    out.setdefault(_join(posixpath.dirname(ncx), content.get("src", "")),
                                   " ".join((label.text or "").split()))
    except (KeyError, ET.ParseError):
        return out   # no table of contents: chapters are named by their headings
    return out


# ------------------------------------------------------------------------------------------ a long read, announced
READ_NOTICE_S = 30.0   # a read estimated at least this long is announced (KVCLI_READ_NOTICE_S: seconds, "off")
PROBE_TOKENS = 256     # with no speed known, the document's first tokens prefilled once to measure one
PROBE_FROM = 8192      # ... only for a document at least this long: a shorter one is read without a probe
SPEEDS = "read-speeds.json"


def speeds_path() -> Path:
    return Path(os.environ.get("KVCLI_CACHE", Path.home() / ".cache" / "kvcli")) / SPEEDS


def speed_key(session, form: str) -> str:
    """What a read's speed is recorded under: the model file, the form of the read ("bounded": in chunks, stored as
    read; "prefill": one prefill), the cache type and the threads asked for ("auto": kvcli's choice)."""
    return f"{Path(session.model_path).name}|{form}|{session.cache_type}|threads {session.n_threads or 'auto'}"


def _speeds() -> dict:
    try:
        d = json.loads(speeds_path().read_text(encoding="utf-8"))
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def read_speed(key: str) -> tuple[float, str] | None:
    """(tokens per second, how it is known) for a read recorded under `key`: KVCLI_READ_TOK_S, else the last read
    of that key measured here; None when neither."""
    raw = os.environ.get("KVCLI_READ_TOK_S", "").strip()
    if raw:
        try:
            v = float(raw)
        except ValueError:
            v = -1.0
        if not (v > 0 and math.isfinite(v)):
            raise KvcliError(f"KVCLI_READ_TOK_S must be a number of tokens per second > 0 (got {raw!r})")
        return v, "KVCLI_READ_TOK_S"
    rec = _speeds().get(key)
    try:
        tok_s, tokens, seconds, when = (float(rec["tok_s"]), int(rec["tokens"]), float(rec["seconds"]),
                                        str(rec["date"]))
    except (TypeError, KeyError, ValueError):
        return None
    if not tok_s > 0:
        return None
    return tok_s, f"measured by the last such read here: {tokens:,} tokens in {_duration(seconds)}, {when}"


def record_read_speed(key: str, tokens: int, seconds: float) -> None:
    """Keep a read's measured speed for the next estimate (a read under 512 tokens measures too little); a cache
    folder that cannot be written is no error."""
    if tokens < 512 or not seconds > 0:
        return
    d = _speeds()
    d[key] = {"tok_s": round(tokens / seconds, 2), "tokens": int(tokens), "seconds": round(seconds, 2),
              "date": time.strftime("%Y-%m-%d")}
    path = speeds_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(d, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def probe_speed(session, tokens: list[int], seq: int) -> tuple[float, str] | None:
    """The prefill speed of the document's first PROBE_TOKENS tokens in the empty sequence `seq` (cleared after);
    None for a document shorter than PROBE_FROM (its read is not long enough to measure first)."""
    if len(tokens) < PROBE_FROM:
        return None
    n = min(PROBE_TOKENS, len(tokens))
    t0 = time.perf_counter()
    try:
        session.prefill(list(tokens[:n]), seq=seq)
    finally:
        session.clear(seq)
    seconds = time.perf_counter() - t0
    return n / seconds, f"the prefill speed of its first {n} tokens, measured just now"


def notice_seconds() -> float | None:
    """KVCLI_READ_NOTICE_S: a read estimated at least this long is announced (default READ_NOTICE_S); None: "off"."""
    raw = os.environ.get("KVCLI_READ_NOTICE_S", "").strip().lower()
    if not raw:
        return READ_NOTICE_S
    if raw in ("off", "never", "no"):
        return None
    try:
        v = float(raw)
    except ValueError:
        v = -1.0
    if not (v >= 0 and math.isfinite(v)):
        raise KvcliError(f"KVCLI_READ_NOTICE_S must be a number of seconds >= 0 or 'off' (got {raw!r})")
    return v


def read_notice(n_tokens: int, speed: tuple[float, str] | None, what: str = "reading it") -> str | None:
    """The line that announces a long read: its token count, the time estimated at `speed` ((tokens/s, how it is
    known)) and how it was estimated; None when no speed is known or the estimate is below notice_seconds()."""
    least = notice_seconds()
    if speed is None or least is None:
        return None
    tok_s, how = speed
    seconds = n_tokens / tok_s
    if seconds < least:
        return None
    return (f"this document is {n_tokens:,} tokens: {what} will take about {_duration(seconds)} (estimated at "
            f"{tok_s:,.0f} tokens/s: {how})")


def announce_read(session, tokens: list[int], form: str, what: str = "reading it", probe_seq: int | None = None,
                  say=None) -> str:
    """Announce a long read before it starts: the `read_notice` line for `tokens` read in `form` ("prefill": one
    prefill; "chunked": in chunks, each compressed; "bounded": in chunks stored as read), at the speed `read_speed`
    knows, else at the speed of a `probe_speed` in the empty sequence `probe_seq` (none where it is None or holds
    something); said through `say` (default: "[line]" on stderr). Returns the key the read's measured speed is to be
    recorded under (`record_read_speed`)."""
    key = speed_key(session, form)
    speed = read_speed(key)
    if speed is None and probe_seq is not None and notice_seconds() is not None \
            and probe_seq not in session.seqs:
        speed = probe_speed(session, tokens, probe_seq)
    line = read_notice(len(tokens), speed, what)
    if line is not None:
        if say is not None:
            say(line)
        else:
            print(f"[{line}]", file=sys.stderr, flush=True)
    return key


def _duration(seconds: float) -> str:
    s = max(0, round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"
