"""README.md is a product page (issue #65): at most 150 lines, its first table within the first 60, the three
measured tables (one question, a chat, a book) and the score-against-memory figure; the dates, machines and caveats of
its figures are in docs/results/headline.md, which it links."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
MOST_LINES, FIRST_TABLE_BY = 150, 60


def tables(lines: list[str]) -> list[int]:
    """The line (1-based) each table's header row is on: a row followed by a |---| rule."""
    return [i + 1 for i in range(len(lines) - 1)
            if lines[i].startswith("|") and re.match(r"^\|(\s*:?-+:?\s*\|)+\s*$", lines[i + 1])]


def test_tables_are_found():
    assert tables(["text", "| a | b |", "|---|:--:|", "| 1 | 2 |", "", "| c |", "|---|"]) == [2, 6]
    assert tables(["| a |", "| b |"]) == []


def test_the_readme_is_a_product_page():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MOST_LINES, f"README.md is {len(lines)} lines: at most {MOST_LINES} (details go to docs/)"
    found = tables(lines)
    assert len(found) >= 3, "README.md lost one of its three measured tables (one question, a chat, a book)"
    assert found[0] <= FIRST_TABLE_BY, f"README.md's first table is on line {found[0]}: within {FIRST_TABLE_BY}"
    text = "\n".join(lines)
    assert re.search(r"!\[[^\]]*\]\(docs/score-vs-bytes[^)]*\.png\)", text), "the score-against-memory figure"
    assert "docs/results/headline.md" in text, "the link to where each figure's command, machine and date are"
    dated = [f"{i}: {s.strip()[:60]}" for i, s in enumerate(lines, 1)
             if re.search(r"\b20\d\d-\d\d-\d\d\b|\b(EPYC|Xeon)\b", s)]
    assert not dated, "dates and machine names belong in docs/results/:\n" + "\n".join(dated)


NUMBERS = {w: i for i, w in enumerate("zero one two three four five six seven eight nine ten eleven twelve thirteen "
                                      "fourteen fifteen sixteen seventeen eighteen nineteen twenty".split())}


def test_the_readme_counts_the_policies_the_registry_holds():
    """'the N policies' says how many `kvcli policies` lists (it said twelve after keydiff and tova made fourteen)."""
    from kvcli import policies
    said = re.findall(r"\b(\w+) policies\b", README.read_text(encoding="utf-8"))
    counts = [NUMBERS.get(w.lower(), int(w) if w.isdigit() else None) for w in said]
    counts = [n for n in counts if n is not None]
    assert counts, "README.md no longer says how many policies there are (drop this test with it)"
    assert all(n == len(policies.available()) for n in counts), (said, policies.available())
