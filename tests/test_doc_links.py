"""Every relative link in README.md and docs/**/*.md resolves: the file (or folder) it names exists, and a
#anchor names a heading of the file it points to (GitHub's anchors: lowercased, punctuation dropped, spaces to
hyphens, a repeated heading suffixed -1, -2, ...). Links inside code (fenced blocks, `inline code`) are not links."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")   # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code."""
    return _CODE.sub("", _FENCE.sub("", text))


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # a link: its text
    text = re.sub(r"[`*_~]|<[^>]+>", lambda m: "_" if m.group(0) == "_" else "", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in _HEADING.finditer(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        a = anchor(m.group(2))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    out |= set(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text(encoding="utf-8")))
    return out


def links(path: Path) -> list[str]:
    text = _prose(path.read_text(encoding="utf-8"))
    return [m.group(1) for m in _INLINE.finditer(text)] + [m.group(1) for m in _REFERENCE.finditer(text)]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken_links(path: Path) -> list[str]:
    out = []
    for link in links(path):
        if _EXTERNAL.match(link) or link.startswith("//"):
            continue
        target, _, frag = link.partition("#")
        dest = (path.parent / unquote(target)).resolve() if target else path
        if not dest.exists():
            out.append(f"{link} (no {_name(dest)})")
        elif frag and dest.suffix == ".md" and dest.is_file() and unquote(frag).lower() not in anchors(dest):
            out.append(f"{link} (no heading #{frag} in {_name(dest)})")
    return out


def test_anchors_as_github_makes_them():
    assert anchor("Set-up and the two commands") == "set-up-and-the-two-commands"
    assert anchor("`kvcli run`: one question") == "kvcli-run-one-question"
    assert anchor("What's measured (2026-11-28)") == "whats-measured-2026-11-28"
    assert anchor("A [linked](x.md) heading") == "a-linked-heading"


def test_the_checker_finds_a_broken_link(tmp_path):
    doc = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Title\n\n## Part one\n")
    doc.write_text("[ok](b.md) [ok](b.md#part-one) [web](https://x.org/y) ![img](b.md)\n"
                   "[gone](c.md) [no heading](b.md#part-two) `[code](d.md)`\n\n```\n[fenced](e.md)\n```\n"
                   "[self](#here)\n\n## Here\n")
    assert sorted(x.split(" ")[0] for x in broken_links(doc)) == ["b.md#part-two", "c.md"]


def test_every_relative_link_in_the_docs_resolves():
    broken = [f"{p.relative_to(ROOT)}: {x}" for p in doc_files() for x in broken_links(p)]
    assert not broken, "broken links:\n" + "\n".join(broken)
