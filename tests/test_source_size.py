"""No source file of kvcli's own is over 800 lines (docs/development.md, "Layout": a file that grows past that is split
along the ideas it holds): the Python package and the native engine's C++. Files git ignores (the vendored
llama_cpp bindings the set-up copies into kvcli/native/_vendor/, build outputs) are not kvcli's own."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 800
SOURCES = {"kvcli": (".py",), "native/src": (".py", ".cpp", ".h")}
VENDORED = ("_vendor",)   # left out where git cannot say what it ignores


def source_files() -> list[Path]:
    try:   # tracked, and untracked but not ignored (a new file counts before it is committed)
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z", *SOURCES],
                             cwd=ROOT, capture_output=True, check=True).stdout.decode()
        paths = [ROOT / p for p in out.split("\0") if p]
    except (OSError, subprocess.CalledProcessError):   # not a git checkout
        paths = [p for folder in SOURCES for p in (ROOT / folder).rglob("*")
                 if not any(part in VENDORED for part in p.parts)]
    return sorted(p for p in paths if p.is_file() and any(
        p.relative_to(ROOT).as_posix().startswith(folder + "/") and p.suffix in suffixes
        for folder, suffixes in SOURCES.items()))


def test_the_sources_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in source_files()}
    assert {"kvcli/cli.py", "kvcli/apps/chat.py"} <= names
    assert any(n.startswith("native/src/") and n.endswith(".cpp") for n in names)
    assert any(n.startswith("native/src/") and n.endswith(".h") for n in names)
    assert not any("/_vendor/" in n for n in names)


def test_no_source_file_is_over_800_lines():
    over = []
    for p in source_files():
        n = len(p.read_text(encoding="utf-8", errors="replace").splitlines())
        if n > LIMIT:
            over.append(f"{p.relative_to(ROOT)}: {n} lines")
    assert not over, f"over {LIMIT} lines (split along the ideas it holds):\n" + "\n".join(over)
