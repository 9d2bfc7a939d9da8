"""Small real documents of each format kvcli reads, written at test time with the libraries (pypdf, python-docx,
zipfile), all holding the same text: `PARAGRAPHS` joined by blank lines (`plain_text()`), which is exactly what each
converts to. Also the bad files each format can be (scanned, encrypted, damaged)."""
from __future__ import annotations

import io
import zipfile
from html import escape
from pathlib import Path

TITLE = "The Station Log"
# (heading level or 0 for a paragraph, text); each chapter (level 1) begins a page of the PDF and a file of the EPUB
PARAGRAPHS = [
    (1, "Chapter 1: Arrival"),
    (0, "The survey team reached the northern station on a cold Monday morning."),
    (0, "Mara Lindqvist kept the keys to the supply shed in her coat pocket."),
    (2, "1.1 The lower lake"),
    (0, "The locker number of the lower lake is 4127, painted in red on its door."),
    (1, "Chapter 2: The storm"),
    (0, "A storm closed the pass on Thursday, and the radio went quiet for two days."),
    (0, "The team counted forty-two jars of honey in the pantry while they waited."),
]


def plain_text() -> str:
    return "\n\n".join(t for _, t in PARAGRAPHS)


def chapters() -> list[list[tuple[int, str]]]:
    out = []
    for level, t in PARAGRAPHS:
        if level == 1:
            out.append([])
        out[-1].append((level, t))
    return out


def toc_labels() -> list[str]:
    """The chapters' names in an EPUB's table of contents (not their headings: "Arrival", "The storm")."""
    return [ch[0][1].split(": ", 1)[1] for ch in chapters()]


# ------------------------------------------------------------------------------------------ PDF (pypdf)
def pdf_bytes(pages: list[list[str]] | None = None, *, encrypt: str | None = None, outline: bool = True,
              owner: str = "owner") -> bytes:
    """A PDF whose pages hold `pages` (lines of text, a blank line between them) in Helvetica, drawn with PDF's text
    operators; by default one page per chapter, with an outline entry per chapter."""
    from pypdf import PdfWriter
    from pypdf.generic import DictionaryObject, NameObject, StreamObject
    if pages is None:
        pages = [[t for _, t in ch] for ch in chapters()]
    w = PdfWriter()
    font = w._add_object(DictionaryObject({
        NameObject("/Type"): NameObject("/Font"), NameObject("/Subtype"): NameObject("/Type1"),
        NameObject("/BaseFont"): NameObject("/Helvetica"), NameObject("/Encoding"): NameObject("/WinAnsiEncoding")}))
    for lines in pages:
        page = w.add_blank_page(612, 792)
        if not lines:
            continue
        ops = ["BT", "/F1 10 Tf", "14 TL", "40 740 Td"]
        for i, line in enumerate(lines):
            if i:
                ops.append("T* T*")   # a blank line between paragraphs
            ops.append("(" + line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)") + ") Tj")
        ops.append("ET")
        content = StreamObject()
        content.set_data("\n".join(ops).encode("latin-1"))
        page[NameObject("/Contents")] = w._add_object(content)
        page[NameObject("/Resources")] = DictionaryObject({
            NameObject("/Font"): DictionaryObject({NameObject("/F1"): font})})
    if outline and pages and pages[0]:
        for i, lines in enumerate(pages):
            w.add_outline_item(title=lines[0], page_number=i)
    if encrypt is not None:
        w.encrypt(user_password=encrypt, owner_password=owner, algorithm="RC4-128")
    out = io.BytesIO()
    w.write(out)
    return out.getvalue()


def scanned_pdf_bytes(n_pages: int = 3) -> bytes:
    """A PDF of pages with no text layer (as a scanner makes: images only; here, nothing drawn)."""
    return pdf_bytes([[] for _ in range(n_pages)], outline=False)


# ------------------------------------------------------------------------------------------ DOCX (python-docx)
def docx_bytes(page_breaks: bool = True) -> bytes:
    import docx
    d = docx.Document()
    for i, ch in enumerate(chapters()):
        if i and page_breaks:
            d.add_page_break()
        for level, t in ch:
            d.add_heading(t, level) if level else d.add_paragraph(t)
    out = io.BytesIO()
    d.save(out)
    return out.getvalue()


# ------------------------------------------------------------------------------------------ HTML, EPUB (zipfile)
def html_page(items: list[tuple[int, str]], title: str = TITLE) -> str:
    body = "\n".join(f"<h{lv}>{escape(t)}</h{lv}>" if lv else f"<p>\n  {escape(t)}\n</p>" for lv, t in items)
    return (f'<?xml version="1.0" encoding="utf-8"?>\n<!DOCTYPE html>\n<html xmlns="http://www.w3.org/1999/xhtml">\n'
            f"<head><title>{escape(title)}</title><style>p {{ margin: 0 }}</style>"
            f"<script>var x = 1;</script></head>\n<body>\n{body}\n</body>\n</html>\n")


def html_bytes() -> bytes:
    return html_page(PARAGRAPHS).encode("utf-8")


def epub_bytes(*, drm: bool = False, version: int = 3) -> bytes:
    """An EPUB 3 (its table of contents a navigation document) or EPUB 2 (an NCX file), a chapter a file."""
    chs = chapters()
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr(zipfile.ZipInfo("mimetype"), "application/epub+zip")   # first and stored, as the format asks
        z.writestr("META-INF/container.xml",
                   '<?xml version="1.0"?><container version="1.0" '
                   'xmlns="urn:oasis:names:tc:opendocument:xmlns:container"><rootfiles><rootfile '
                   'full-path="OEBPS/content.opf" media-type="application/oebps-package+xml"/></rootfiles></container>')
        items = "".join(f'<item id="c{i}" href="text/ch{i}.xhtml" media-type="application/xhtml+xml"/>'
                        for i in range(len(chs)))
        spine = "".join(f'<itemref idref="c{i}"/>' for i in range(len(chs)))
        spine_attr = "" if version == 3 else ' toc="ncx"'
        toc_item = ('<item id="nav" href="nav.xhtml" media-type="application/xhtml+xml" properties="nav"/>'
                    if version == 3 else '<item id="ncx" href="toc.ncx" media-type="application/x-dtbncx+xml"/>')
        z.writestr("OEBPS/content.opf",
                   '<?xml version="1.0" encoding="utf-8"?><package xmlns="http://www.idpf.org/2007/opf" '
                   f'version="{version}.0" unique-identifier="id"><metadata '
                   'xmlns:dc="http://purl.org/dc/elements/1.1/">'
                   f'<dc:identifier id="id">kvcli-test</dc:identifier><dc:title>{TITLE}</dc:title>'
                   f'<dc:language>en</dc:language></metadata><manifest>{toc_item}'
                   f'{items}</manifest><spine{spine_attr}>{spine}</spine></package>')
        if version == 3:
            links = "".join(f'<li><a href="text/ch{i}.xhtml">{escape(t)}</a></li>' for i, t in enumerate(toc_labels()))
            z.writestr("OEBPS/nav.xhtml",
                       '<?xml version="1.0" encoding="utf-8"?><html xmlns="http://www.w3.org/1999/xhtml" '
                       'xmlns:epub="http://www.idpf.org/2007/ops"><head><title>Contents</title></head><body>'
                       f'<nav epub:type="toc"><ol>{links}</ol></nav></body></html>')
        else:
            points = "".join(f'<navPoint id="p{i}" playOrder="{i + 1}"><navLabel><text>{escape(t)}</text>'
                             f'</navLabel><content src="text/ch{i}.xhtml"/></navPoint>'
                             for i, t in enumerate(toc_labels()))
            z.writestr("OEBPS/toc.ncx",
                       '<?xml version="1.0" encoding="utf-8"?><ncx xmlns="http://www.daisy.org/z3986/2005/ncx/" '
                       f'version="2005-1"><head/><docTitle><text>{TITLE}</text></docTitle><navMap>{points}</navMap>'
                       "</ncx>")
        for i, ch in enumerate(chs):
            z.writestr(f"OEBPS/text/ch{i}.xhtml", html_page(ch, title=ch[0][1]))
        if drm:
            z.writestr("META-INF/encryption.xml",
                       '<encryption xmlns="urn:oasis:names:tc:opendocument:xmlns:container" '
                       'xmlns:enc="http://www.w3.org/2001/04/xmlenc#"><enc:EncryptedData><enc:CipherData>'
                       '<enc:CipherReference URI="OEBPS/text/ch0.xhtml"/></enc:CipherData></enc:EncryptedData>'
                       '</encryption>')
    return out.getvalue()


def write_all(folder: Path, stem: str = "book") -> dict[str, Path]:
    """The same text as .txt, .md, .html, .pdf, .epub and .docx in `folder`."""
    md = "\n\n".join(("#" * lv + " " + t) if lv else t for lv, t in PARAGRAPHS)
    files = {"txt": plain_text().encode(), "md": md.encode(), "html": html_bytes(), "pdf": pdf_bytes(),
             "epub": epub_bytes(), "docx": docx_bytes()}
    out = {}
    for ext, data in files.items():
        (folder / f"{stem}.{ext}").write_bytes(data)
        out[ext] = folder / f"{stem}.{ext}"
    return out
