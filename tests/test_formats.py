"""Documents in PDF, EPUB, DOCX, HTML and Markdown (kvcli/doc_formats.py, kvcli/documents.py): real files of each
format written by the test (tests/format_samples.py), converted to the same text with their page, chapter and
section boundaries; a conversion cached by content; each bad file refused in one line, exit 2, with nothing left in
the document store; and `kvcli run` on each format answering as on the .txt of the same text."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import format_samples as fs
import pytest
from kvcli import doc_formats, document_store
from kvcli.documents import cache_dir, convert_bytes, open_document, open_documents, read_document
from kvcli.errors import KvcliError

pytestmark = pytest.mark.usefixtures("cache_dir")   # conversions are cached in the test's own folder
ROOT = Path(__file__).resolve().parents[1]
KVCLI = [sys.executable, "-m", "kvcli.cli"]


@pytest.fixture()
def files(tmp_path, cache_dir):
    return fs.write_all(tmp_path)


def _words(t: str) -> list[str]:
    return t.split()


# ------------------------------------------------------------------------------------------ conversions
def test_every_format_converts_to_the_same_text(files):
    plain = fs.plain_text()
    for ext in ("txt", "html", "epub", "docx"):
        doc = open_document(str(files[ext]))
        assert doc.text == plain, (ext, doc.text)
        assert doc.format == {"txt": "text"}.get(ext, ext)
    pdf = open_document(str(files["pdf"]))
    assert pdf.format == "pdf" and _words(pdf.text) == _words(plain)   # a PDF's paragraphs: one line break apart
    md = open_document(str(files["md"]))
    assert md.format == "markdown" and md.text == files["md"].read_text()   # Markdown is read as it is


def _at(doc, kind):
    return [(b.label, doc.text[b.start:b.start + len(b.label)] if kind != "page" else doc.text[b.start:][:10], b.level)
            for b in doc.of_kind(kind)]


def test_boundaries_are_offsets_of_pages_chapters_and_sections(files):
    headings = [(t, lv) for lv, t in fs.PARAGRAPHS if lv]
    for ext in ("html", "docx", "md", "epub"):
        doc = open_document(str(files[ext]))
        secs = doc.of_kind("section")
        assert [(b.label, b.level) for b in secs] == headings, ext
        for b in secs:   # each offset is where the heading's text begins (after "# " in Markdown)
            assert doc.text[b.start:].lstrip("# ").startswith(b.label), (ext, b)
    chapters = [t for lv, t in fs.PARAGRAPHS if lv == 1]
    epub2 = files["epub"].with_name("book2.epub")
    epub2.write_bytes(fs.epub_bytes(version=2))
    for path in (files["epub"], epub2):   # EPUB 3 (a navigation document) and EPUB 2 (an NCX file)
        epub = open_document(str(path))
        assert epub.text == fs.plain_text()
        assert [b.label for b in epub.of_kind("chapter")] == fs.toc_labels()   # named by the table of contents
        assert [epub.text[b.start:].split("\n")[0] for b in epub.of_kind("chapter")] == chapters
    pdf = open_document(str(files["pdf"]))
    assert [b.label for b in pdf.of_kind("page")] == ["1", "2"]
    assert [pdf.text[b.start:].split("\n")[0] for b in pdf.of_kind("page")] == chapters   # a chapter a page
    assert [(b.label, b.level) for b in pdf.of_kind("section")] == [(c, 1) for c in chapters]   # its outline
    docx = open_document(str(files["docx"]))
    assert [b.label for b in docx.of_kind("page")] == ["1", "2"]   # the hard page break before chapter 2
    assert docx.text[docx.of_kind("page")[1].start:].startswith(chapters[1])
    where = pdf.where(pdf.text.index("4127"))
    assert where["page"].label == "1" and where["section"].label == chapters[0]
    assert docx.where(docx.text.index("honey"))["page"].label == "2"
    assert open_document(str(files["txt"])).boundaries == []


def test_form_feeds_are_pages_and_joined_documents_keep_their_boundaries(tmp_path, files):
    (tmp_path / "ff.txt").write_text("one\n\ftwo\n\fthree")
    assert [(b.label, b.start) for b in open_document(str(tmp_path / "ff.txt")).of_kind("page")] == \
        [("1", 0), ("2", 5), ("3", 10)]
    joined = open_documents([str(files["txt"]), str(files["epub"])])
    assert joined.text.startswith("### book.txt\n\n" + read_document(str(files["txt"])) + "\n\n### book.epub")
    docs = joined.of_kind("document")
    assert [b.label for b in docs] == ["book.txt", "book.epub"]
    assert joined.text[docs[1].start:].startswith("### book.epub\n\nChapter 1: Arrival")
    assert [joined.text[b.start:].split("\n")[0] for b in joined.of_kind("chapter")] == \
        [t for lv, t in fs.PARAGRAPHS if lv == 1]


def test_a_pdf_an_epub_and_a_docx_are_known_by_content(files, tmp_path):
    for ext in ("pdf", "epub", "docx"):
        p = tmp_path / f"misnamed-{ext}"   # no suffix (and standard input): the content says
        p.write_bytes(files[ext].read_bytes())
        assert open_document(str(p)).format == ext
    assert convert_bytes(fs.html_bytes(), "standard input").format == "html"   # <!DOCTYPE html> on stdin


def test_a_partly_scanned_pdf_is_read_with_a_warning(capsys):
    part = fs.pdf_bytes([["Text on the first page."], [], [], ["Text on the last."]], outline=False)
    doc = convert_bytes(part, "part.pdf")
    assert doc.text == "Text on the first page.\n\n\n\n\n\nText on the last."
    assert [b.start for b in doc.of_kind("page")] == [0, 25, 27, 29]
    assert capsys.readouterr().err == "kvcli: warning: part.pdf: 2 of 4 pages hold no text (scanned?)\n"
    assert convert_bytes(part, "again.pdf").text == doc.text   # from the cache: the warning said again
    assert capsys.readouterr().err == "kvcli: warning: again.pdf: 2 of 4 pages hold no text (scanned?)\n"


def test_pdf_page_labels_and_docx_tables():
    from pypdf import PdfReader, PdfWriter
    w = PdfWriter(clone_from=PdfReader(io.BytesIO(fs.pdf_bytes())))
    w.set_page_label(0, 1, style="/r")   # pages numbered i, ii (as a book's front matter)
    out = io.BytesIO()
    w.write(out)
    assert [b.label for b in convert_bytes(out.getvalue(), "r.pdf").of_kind("page")] == ["i", "ii"]
    import docx
    d = docx.Document()
    d.add_heading("Prices", 1)
    t = d.add_table(rows=2, cols=2)
    for r, row in enumerate([("item", "cost"), ("honey", "4 crowns")]):
        for c, v in enumerate(row):
            t.cell(r, c).text = v
    d.add_paragraph("After the table.")
    out = io.BytesIO()
    d.save(out)
    doc = convert_bytes(out.getvalue(), "t.docx")
    assert doc.text == "Prices\n\nitem | cost\nhoney | 4 crowns\n\nAfter the table."
    assert [(b.kind, b.label, b.start) for b in doc.boundaries] == [("section", "Prices", 0)]


def test_markdown_headings():
    md = ("---\ntitle: x\n---\n# One\n\n```\n# not a heading\n```\nTwo\n===\n\nThree ##\n---\n\n- item\n---\n"
          "  ### Four ###\n")
    doc = convert_bytes(md.encode(), "n.md")
    assert doc.text == md
    assert [(b.label, b.level, md[b.start:b.start + 3]) for b in doc.boundaries] == \
        [("One", 1, "# O"), ("Two", 1, "Two"), ("Three ##", 2, "Thr"), ("Four", 3, "###")]


def test_html_details():
    page = ("<html><head><title>T</title><style>x{}</style></head><body><h1>Top &amp; more</h1>"
            "<ul><li>one</li><li>two <b>bold</b></li></ul><table><tr><th>a</th><th>b</th></tr>"
            "<tr><td>1</td><td>2</td></tr></table><pre>  keep\n  this</pre><script>no()</script>"
            "<p>caf&eacute;<br>next</p></body></html>")
    doc = convert_bytes(page.encode(), "x.html")
    assert doc.text == "Top & more\n\n- one\n- two bold\n\na | b\n1 | 2\n\n  keep\n  this\n\ncafé\nnext"
    assert [(b.label, b.start) for b in doc.boundaries] == [("Top & more", 0)]
    sphinx = convert_bytes(b'<h2><span class="n">4.1. </span>Standards<a class="headerlink" href="#s">\xc2\xb6</a>'
                           b"</h2><p>x</p>", "s.html")   # a heading in pieces, its permalink sign dropped
    assert sphinx.text == "4.1. Standards\n\nx" and sphinx.boundaries[0].label == "4.1. Standards"
    latin = '<meta charset="iso-8859-1"><p>caf\xe9</p>'.encode("latin-1")   # the charset it declares
    assert convert_bytes(latin, "l.html").text == "café"


# ------------------------------------------------------------------------------------------ the conversion cache
def test_a_conversion_is_cached_by_content(files, tmp_path, monkeypatch):
    first = open_document(str(files["pdf"]))
    sha = __import__("hashlib").sha256(files["pdf"].read_bytes()).hexdigest()
    assert (cache_dir() / f"{sha}.json").is_file()
    assert cache_dir().parent == document_store.root()
    assert document_store.entries() == []   # the cache is no entry of the store (not listed, not swept)

    def fail(*a):
        raise AssertionError("converted again")
    monkeypatch.setattr(doc_formats, "pdf", fail)
    copy = tmp_path / "copy.pdf"   # another name, the same bytes: the same cached conversion
    copy.write_bytes(files["pdf"].read_bytes())
    again = open_document(str(copy))
    assert again.text == first.text and again.boundaries == first.boundaries and again.name == str(copy)
    (cache_dir() / f"{sha}.json").write_text("{damaged")   # a damaged cache file is converted again, not an error
    monkeypatch.undo()
    assert open_document(str(copy)).text == first.text
    assert json.loads((cache_dir() / f"{sha}.json").read_text())["text"] == first.text


def test_the_cache_is_capped(files, monkeypatch):
    import kvcli.documents as documents
    monkeypatch.setattr(documents, "CACHE_MAX_BYTES", 1)
    open_document(str(files["pdf"]))
    open_document(str(files["epub"]))
    assert len(list(cache_dir().glob("*.json"))) <= 1


# ------------------------------------------------------------------------------------------ bad files
def _zip(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for k, v in members.items():
            z.writestr(k, v)
    return out.getvalue()


def bad_files() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, what its one line says)."""
    pdf, epub, docx = fs.pdf_bytes(), fs.epub_bytes(), fs.docx_bytes()
    return {
        "scanned.pdf": (fs.scanned_pdf_bytes(3), "has no text layer (a scanned PDF?): none of its 3 pages holds text"),
        "encrypted.pdf": (fs.pdf_bytes(encrypt="secret"), "is an encrypted PDF (password-protected)"),
        "damaged.pdf": (pdf[:len(pdf) // 2], "is not a readable PDF (damaged?)"),
        "notpdf.pdf": (b"just words", "is not a readable PDF"),
        "damaged.epub": (epub[:len(epub) // 2], "is not a readable EPUB (damaged?)"),
        "nospine.epub": (_zip({"META-INF/container.xml": b"<container/>"}), "is not a readable EPUB (damaged?)"),
        "drm.epub": (fs.epub_bytes(drm=True), "is an encrypted (DRM-protected) EPUB"),
        "damaged.docx": (docx[:len(docx) // 2], "is not a readable DOCX (damaged?)"),
        "locked.docx": (b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(600), "password-protected or old-format Word"),
        "image.png": (b"\x89PNG\r\n\x1a\n" + bytes(100), "is not a text file nor a document kvcli reads (a PNG image)"),
        "archive.zip": (_zip({"a.txt": b"hi"}), "(a ZIP archive)"),
        "program.bin": (bytes(range(256)) * 8, "is not a text file nor a document kvcli reads (it contains NUL"),
        "empty.txt": (b" \n", "is empty"),
        "empty.html": (b"<html><body><script>x()</script></body></html>", "is empty (an HTML page with no text)"),
        "empty.docx": (_empty_docx(), "is empty (a DOCX with no text)"),
        "empty.epub": (_zip({"META-INF/container.xml": b'<container xmlns="urn:oasis:names:tc:opendocument:xmlns:'
                             b'container"><rootfiles><rootfile full-path="c.opf"/></rootfiles></container>',
                             "c.opf": b'<package xmlns="http://www.idpf.org/2007/opf"><manifest/><spine/></package>'}),
                       "is empty (an EPUB with no text)"),
    }


def _empty_docx() -> bytes:
    import docx
    out = io.BytesIO()
    docx.Document().save(out)
    return out.getvalue()


def test_each_bad_file_is_one_clear_reason(tmp_path):
    for name, (data, says) in bad_files().items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(KvcliError) as e:
            open_document(str(tmp_path / name))
        assert says in str(e.value) and "\n" not in str(e.value), (name, str(e.value))


def test_a_pdf_locked_only_by_its_owner_password_is_read():
    """Many "protected" PDFs have an empty user password (printing or copying restricted): their text is readable."""
    doc = convert_bytes(fs.pdf_bytes(encrypt=""), "owner-only.pdf")
    assert _words(doc.text) == _words(fs.plain_text())


def _kvcli(*args, data: bytes | None = None, env=None):
    return subprocess.run([*KVCLI, *map(str, args)], input=data, capture_output=True, timeout=300, cwd=ROOT,
                          env={**os.environ, **(env or {})})


def _one_line(code: int, err: str, says: str, name: str) -> None:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("kvcli: error:"), (name, err)
    assert says in lines[0], (name, lines[0])


def _store_is_empty(cache_dir) -> None:
    root = cache_dir / "documents"
    assert not root.exists() or list(root.iterdir()) == [], list(root.iterdir())


def test_bad_files_exit_2_in_one_line_leaving_nothing(cli_runner, tmp_path, cache_dir):
    from kvcli.cli import cli
    for name, (data, says) in bad_files().items():
        (tmp_path / name).write_bytes(data)
        r = cli_runner.invoke(cli, ["run", "--doc", str(tmp_path / name), "q"])
        _one_line(r.exit_code, r.stderr, says, name)
        _store_is_empty(cache_dir)


@pytest.mark.parametrize("command", [
    ["run", "--doc", "{}", "q"], ["chat", "--doc", "{}", "--question", "q"],
    ["compress", "--doc", "{}", "-o", "{}.kvc", "--policy", "snapkv", "--budget", "64"],
    ["check", "--doc", "{}", "--policy", "snapkv", "--budget", "64"],
    ["bench", "--docs", "{}", "--policies", "snapkv", "--budgets", "64"]])
def test_every_command_refuses_them_so(command, tmp_path, cache_dir):
    """As a process (nothing else on stderr: no library's warning, no traceback), for each command that reads --doc."""
    name = "scanned.pdf"
    data, says = bad_files()[name]
    p = tmp_path / name
    p.write_bytes(data)
    r = _kvcli(*[a.replace("{}", str(p)) for a in command])
    _one_line(r.returncode, r.stderr.decode(), says, name)
    assert not (tmp_path / f"{name}.kvc").exists()
    _store_is_empty(cache_dir)


@pytest.mark.parametrize("command", [["run", "--doc", "-", "q"], ["run", "q"],
                                     ["compress", "--doc", "-", "-o", "{}", "--policy", "snapkv", "--budget", "64"],
                                     ["check", "--doc", "-", "--policy", "snapkv", "--budget", "64"]])
def test_standard_input_is_converted_too(command, tmp_path, cache_dir):
    out = tmp_path / "piped.kvc"
    r = _kvcli(*[a.replace("{}", str(out)) for a in command], data=fs.scanned_pdf_bytes(2))
    assert r.returncode == 2 and r.stderr.decode().strip() == (
        "kvcli: error: standard input has no text layer (a scanned PDF?): none of its 2 pages holds text; run OCR on "
        "it first (e.g. ocrmypdf)"), r.stderr.decode()
    assert not out.exists()
    _store_is_empty(cache_dir)


def test_batch_reads_every_format(files):
    from kvcli.apps.batch import DOC_SUFFIXES, read_job
    for ext in ("pdf", "epub", "docx", "html"):
        job = read_job(str(files[ext]), "fp")
        assert job.error is None and _words(job.text) == _words(fs.plain_text()), ext
        assert f".{ext}" in DOC_SUFFIXES
    bad = files["pdf"].with_name("scan.pdf")
    bad.write_bytes(fs.scanned_pdf_bytes(1))
    assert "none of its 1 page holds text" in read_job(str(bad), "fp").error


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_each_format_answers_as_its_text(files, tmp_path, cache_dir):
    """`kvcli run --doc book.EXT` on the default model, greedy: the same prompt tokens and answer as the .txt of the
    text it converts to (which, but for the PDF's paragraph breaks, is the same text for every format); the PDF, read
    in 5 prompt tokens fewer, answers as the .txt too, and every format cites the answer's line first."""
    q = ["What is the locker number of the lower lake?", "-n", "16", "--json"]
    pdf_txt = tmp_path / "pdf-as-text.txt"
    pdf_txt.write_text(open_document(str(files["pdf"])).text, encoding="utf-8")
    runs = {}
    for name, path in (("txt", files["txt"]), ("html", files["html"]), ("epub", files["epub"]),
                       ("docx", files["docx"]), ("pdf", files["pdf"]), ("pdf-as-text", pdf_txt)):
        r = _kvcli("run", "--doc", path, *q)
        assert r.returncode == 0, r.stderr.decode()
        runs[name] = json.loads(r.stdout)
    for name in ("html", "epub", "docx"):
        assert runs[name]["answer"] == runs["txt"]["answer"], name
        assert runs[name]["stats"]["prompt_tokens"] == runs["txt"]["stats"]["prompt_tokens"], name
    assert runs["pdf"]["answer"] == runs["pdf-as-text"]["answer"]
    assert runs["pdf"]["stats"]["prompt_tokens"] == runs["pdf-as-text"]["stats"]["prompt_tokens"]
    assert runs["pdf"]["answer"] == runs["txt"]["answer"] and "4127" in runs["txt"]["answer"]
    for name in ("txt", "html", "epub", "docx", "pdf"):   # the one passage that holds the answer, cited first
        assert "4127" in runs[name]["citations"][0]["quote"], (name, runs[name]["citations"])
    r = _kvcli("run", "--doc", "-", *q, data=files["pdf"].read_bytes())   # a PDF piped on standard input
    assert r.returncode == 0 and json.loads(r.stdout)["answer"] == runs["pdf"]["answer"]
    assert document_store.entries() == []

