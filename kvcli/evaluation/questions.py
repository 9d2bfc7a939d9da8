"""Questions generated from a real document's own text, with answers checked automatically (issue #63).

Nothing is planted: every question quotes or points at text the document already holds, and its answer is a
string taken from that text. Five kinds (`KINDS`):

- `fact`: a sentence holding a number (two or more characters, e.g. "1996", "2.6.32", "0x10") that occurs nowhere
  else in the document is quoted with the number blanked out; the answer is the number as written. Scored by
  containment in the prediction, the number standing alone (not inside a longer number).
- `copy`: the same with a name or identifier written once in the whole document (a word with an inner capital,
  digit, underscore or hyphen, such as "TCP_USER_TIMEOUT" or "--max-time", or, in prose, a capitalised name not
  at the start of a sentence); the answer must be copied exactly: case-sensitive containment.
- `combine`: two `fact` sentences, one from the first third of the document and one from the last third, in one
  question; the answer is both numbers (the score is the share found, as RULER's string_match_all).
- `structure`: a sentence of a section whose heading occurs once in the document; the question asks which section
  holds it; the answer is the heading (numbering such as "4." or "2.1." left out), case-insensitive containment.
  Headings are found by the document's format (the corpus manifest's `format`): man pages' unindented capitals
  and 3-space-indented subsections, underlined titles (reStructuredText, Texinfo and Sphinx text), the KJV's
  chapter lines ("Ruth 2"), licences' numbered clauses. Tables have none.
- `summary`: "Summarise this document in three sentences." scored by `summary_scores`: the numbers and names of
  the summary that the document does not contain (unsupported: invented), the share of them supported, and the
  unigram F1 against the full cache's summary of the same document.

Sentences are taken from the document's paragraphs (lines joined; table rows and KJV verses each alone), six to
sixty words, and a question is only made when its blanked sentence is itself unique in the document. Which
candidates become questions is drawn with a seed taken from the document's sha256, so a document's questions are
the same on every machine.
"""
from __future__ import annotations

import hashlib
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass, field

KINDS = ("fact", "copy", "combine", "structure", "summary")
SUMMARY_QUESTION = "Summarise this document in three sentences."
BLANK = "___"

_NUM = re.compile(r"(?<![\w.,/-])(?:0x[0-9A-Fa-f]+|\d+(?:[.,:]\d+)*)(?![\w]|[.,:]\d)")
_NAME = re.compile(r"(?<![\w-])(?:--?[a-z][\w-]*[a-z0-9]|[A-Za-z][A-Za-z0-9]*(?:[_-][A-Za-z0-9]+)+|"
                   r"[a-z]+[A-Z]\w*|[A-Z][a-z]+[A-Z]\w*|[A-Z]{2,}[0-9]+\w*)(?![\w])")
_CAP = re.compile(r"(?<=[a-z] )[A-Z][a-z]{3,}(?![\w'-])")
_WORD = re.compile(r"[A-Za-z0-9]+")
_RUN = re.compile(r"(?<![\w-])[\w-]+")


@dataclass
class Question:
    kind: str
    doc: str
    question: str
    answers: list[str]
    depth: float | None = None          # where the evidence starts, as a fraction of the document's characters
    meta: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------------ sentences and headings
@dataclass
class Sentence:
    text: str          # whitespace collapsed
    start: int         # character offset of its paragraph in the document


def paragraphs(text: str, fmt: str) -> list[tuple[int, str]]:
    """(offset, paragraph) pairs: blocks between blank lines, lines joined; table rows and KJV verses alone."""
    out, cur, start, pos = [], [], 0, 0
    heads = {off for off, _ in headings(text, fmt)}
    for line in text.split("\n"):
        alone = fmt == "table" or (fmt == "kjv" and re.match(r"\s+\d+ ", line)) or pos in heads
        if not line.strip() or alone:
            if cur:
                out.append((start, " ".join(cur)))
            cur = []
        if line.strip():
            if not cur:
                start = pos
            cur.append(re.sub(r"^\s+\d+ ", "", line).strip() if fmt == "kjv" else line.strip())
            if fmt == "table" or pos in heads:   # a row or a heading is a paragraph of its own
                out.append((start, line.strip()))
                cur = []
        pos += len(line) + 1
    if cur:
        out.append((start, " ".join(cur)))
    return out


def sentences(text: str, fmt: str, min_words: int = 6, max_words: int = 60) -> list[Sentence]:
    out = []
    for start, para in paragraphs(text, fmt):
        parts = [para] if fmt == "table" else re.split(r"(?<=[.!?;])\s+(?=[A-Z(\"'])", para)
        for s in parts:
            s = re.sub(r"[ ]+" if fmt == "table" else r"\s+", " ", s).strip()
            if min_words <= len(s.split()) <= max_words or (fmt == "table" and len(s.split()) >= 2):
                out.append(Sentence(s, start))
    return out


_UNDERLINE = re.compile(r"^([=\-~^*\"+#'`])\1{2,}$")


def headings(text: str, fmt: str) -> list[tuple[int, str]]:
    """(character offset, heading) of the document's section headings, by format."""
    lines = text.split("\n")
    offs, pos = [], 0
    for ln in lines:
        offs.append(pos)
        pos += len(ln) + 1
    out = []
    for i, ln in enumerate(lines):
        s = ln.strip()
        if not s or len(s) > 70:
            continue
        if fmt == "man":
            top = ln == s and re.fullmatch(r"[A-Z][A-Z0-9 ,()/_-]*", s) and len(s) <= 40
            sub = (ln.startswith("   ") and not ln.startswith("    ") and not re.search(r"[.,:;]$", s)
                   and len(s.split()) <= 6 and s[0].isupper())
            if top or sub:
                out.append((offs[i], s))
        elif fmt == "underline":
            nxt = lines[i + 1].strip() if i + 1 < len(lines) else ""
            if _UNDERLINE.match(nxt) and len(nxt) >= len(s) - 1 and not _UNDERLINE.match(s):
                out.append((offs[i], s))
        elif fmt == "kjv":
            if ln == s and re.fullmatch(r"(?:[1-3] ?)?[A-Z][a-z]+(?: of [A-Z][a-z]+)? \d+", s):
                out.append((offs[i], s))
        elif fmt == "legal":
            prev = lines[i - 1].strip() if i else ""
            numbered = re.fullmatch(r"(?:\d+[a-z]?\.(?:\d+\.?)*|Section \d+[.:]?|[A-Z]\.)\s+[A-Z][^.]{2,68}\.?", s)
            capitals = re.fullmatch(r"[A-Z][A-Z ,'-]{6,}", s) and len(s.split()) >= 2
            if (numbered or capitals) and not prev:
                out.append((offs[i], s))
    return out


def heading_answer(heading: str) -> str:
    """A heading as the answer is checked: its numbering ("4.", "2.1.", "Section 3 -") and end dot left out."""
    h = re.sub(r"^(?:Section\s+)?(?:\d+[a-z]?\.?)+(?:\d+)?\s*[-:.]?\s*", "", heading.strip())
    h = re.sub(r"^[A-Z]\.\s+", "", h)
    return h.rstrip(".").strip().strip('"*`').strip() or heading.strip()


# ------------------------------------------------------------------------------ candidates
def _counts(text: str, number: bool) -> Counter:
    """How often each number (standing alone, as _NUM finds it) or each maximal run of word characters and hyphens
    occurs in the text: a name's count is how often it stands alone."""
    return Counter(m.group(0) for m in (_NUM if number else _RUN).finditer(text))


def strength(name: str) -> int:
    """How much of an identifier a name is: 3 with a digit, underscore or inner capital; 2 hyphenated; 1 a word."""
    if re.search(r"[\d_]", name) or re.search(r"[a-z][A-Z]", name):
        return 3
    return 2 if "-" in name else 1


def _clozes(text: str, sents: list[Sentence], kind: str) -> list[tuple[Sentence, str, str]]:
    """(sentence, the blanked sentence, answer) for every once-written number (`fact`), name or identifier
    (`copy`) or capitalised name in running text (`name`)."""
    out, seen = [], set()
    counts = _counts(text, kind == "fact")
    for s in sents:
        found = [m.group(0) for m in _NUM.finditer(s.text)] if kind == "fact" else \
            [m.group(0) for m in _NAME.finditer(s.text)] if kind == "copy" else \
            [m.group(0) for m in _CAP.finditer(s.text)]
        for a in dict.fromkeys(found):
            if kind == "fact" and (len(a) < 2 or not any(c.isdigit() for c in a)):
                continue
            if kind != "fact" and (len(a) < 5 or a in seen):
                continue
            if s.text.count(a) != 1 or counts[a] != 1:
                continue
            blanked = s.text.replace(a, BLANK, 1)
            if len(_WORD.findall(blanked)) < 5:
                continue
            seen.add(a)
            out.append((s, blanked, a))
            break   # one question a sentence
    return out


def _q(s: str) -> str:
    return s.replace("\t", " | ")


def make_questions(doc_id: str, text: str, fmt: str, per_kind: int = 2, seed: str | None = None) -> list[Question]:
    """Up to `per_kind` questions of each kind but `summary` (one), drawn with a seed from the text's sha256."""
    rng = random.Random(seed or hashlib.sha256(text.encode("utf-8")).hexdigest())
    n = max(1, len(text))
    sents = sentences(text, fmt)
    qs: list[Question] = []
    facts = _clozes(text, sents, "fact")
    proper = _clozes(text, sents, "name")
    what = "value" if fmt == "table" else "number"
    picked = [(s, b, a, what) for s, b, a in rng.sample(facts, min(per_kind, len(facts)))]
    if len(picked) < per_kind:   # prose that spells its numbers out (the KJV): a name written once instead
        picked += [(s, b, a, "name") for s, b, a in rng.sample(proper, min(per_kind - len(picked), len(proper)))]
    for s, blanked, a, w in picked:
        qs.append(Question("fact", doc_id, f"The document contains this {'row' if fmt == 'table' else 'sentence'} "
                           f"with one {w} left out as {BLANK}: \"{_q(blanked)}\". What is the missing {w}? "
                           f"Answer with the {w} only.", [a], s.start / n))
    names = _clozes(text, sents, "copy")
    if names:   # the most identifier-like names first
        top = max(strength(a) for _, _, a in names)
        names = [c for c in names if strength(c[2]) == top] if len([c for c in names if strength(c[2]) == top]) \
            >= per_kind else sorted(names, key=lambda c: -strength(c[2]))[:max(per_kind, 8)]
    else:
        names = [c for c in proper if c[2] not in {p[2] for p in picked}]
    for s, blanked, a in rng.sample(names, min(per_kind, len(names))):
        qs.append(Question("copy", doc_id, f"The document contains this {'row' if fmt == 'table' else 'sentence'} "
                           f"with one name left out as {BLANK}: \"{_q(blanked)}\". What is the missing name? Copy it "
                           "exactly as the document writes it.", [a], s.start / n, {"exact": True}))
    early = [f for f in facts if f[0].start < n / 3]
    late = [f for f in facts if f[0].start > 2 * n / 3]
    for _ in range(min(per_kind, len(early), len(late))):
        (s1, b1, a1), (s2, b2, a2) = early.pop(rng.randrange(len(early))), late.pop(rng.randrange(len(late)))
        qs.append(Question("combine", doc_id, "The document contains these two passages, far apart, each with one "
                           f"{what} left out as {BLANK}: (1) \"{_q(b1)}\" (2) \"{_q(b2)}\". Give both missing "
                           f"{what}s, (1) then (2).", [a1, a2], s1.start / n, {"depths": [s1.start / n, s2.start / n]}))
    qs += _structure(doc_id, text, fmt, sents, rng, per_kind)
    qs.append(Question("summary", doc_id, SUMMARY_QUESTION, [], None, {"scored": "summary_scores"}))
    return qs


def _structure(doc_id, text, fmt, sents, rng, per_kind) -> list[Question]:
    hs = headings(text, fmt)
    if len(hs) < 3:
        return []
    names = [heading_answer(h) for _, h in hs]
    unique = {a for a in names if names.count(a) == 1 and len(a) >= 3}
    flat = re.sub(r"\s+", " ", text)
    cands = []
    for k, (off, h) in enumerate(hs):
        ans = heading_answer(h)
        if ans not in unique:
            continue
        end = hs[k + 1][0] if k + 1 < len(hs) else len(text)
        inside = [s for s in sents if off < s.start < end and len(s.text.split()) >= 8 and ans not in s.text
                  and flat.count(s.text[:60]) == 1]
        if inside:
            cands.append((rng.choice(inside), h, ans))
    out = []
    for s, h, ans in rng.sample(cands, min(per_kind, len(cands))):
        what = "chapter" if fmt == "kjv" else "section"
        out.append(Question("structure", doc_id, f"Which {what} of the document contains this sentence: "
                            f"\"{_q(s.text)}\"? Answer with the {what}'s heading.", [ans], s.start / max(1, len(text)),
                            {"heading": h}))
    return out


# ------------------------------------------------------------------------------ scoring
def found(answer: str, prediction: str, exact: bool = False) -> bool:
    """The answer stands in the prediction: numbers alone (not inside a longer number), names as whole words;
    `exact`: case-sensitive."""
    flags = 0 if exact else re.IGNORECASE
    rx = rf"(?<![\w.,-]){re.escape(answer)}(?![\w]|[.,:]\d)" if _NUM.fullmatch(answer) else \
        rf"(?<![\w-]){re.escape(answer)}(?![\w-])"
    return re.search(rx, prediction, flags) is not None


def score_answer(q: Question | dict, prediction: str) -> float:
    """The share of the question's answers found in the prediction (0..1); the summary kind is scored by
    summary_scores instead."""
    q = q if isinstance(q, dict) else q.as_dict()
    if q["kind"] == "summary":
        raise ValueError("a summary is scored with summary_scores")
    exact = q["kind"] == "copy"
    return sum(found(a, prediction, exact) for a in q["answers"]) / len(q["answers"])


def claims(text: str) -> list[str]:
    """The numbers and names a text states: numbers of two or more characters, capitalised words not at the start
    of a sentence, identifiers."""
    nums = [m.group(0) for m in _NUM.finditer(text) if len(m.group(0)) >= 2 or m.group(0).isdigit()]
    names = [m.group(0) for m in _NAME.finditer(text)
             if not re.fullmatch(r"[a-z]+(?:-[a-z]+)+", m.group(0))]   # "open-source" is a word, not a name
    names += [m.group(0) for m in _CAP.finditer(text)]
    return list(dict.fromkeys(nums + names))


def _norm_num(s: str) -> str:
    return s.replace(",", "")


def summary_scores(summary: str, document: str, full_summary: str | None = None) -> dict:
    """Faithfulness of a summary: the numbers and names it states that the document does not contain
    (`unsupported`), the share it states that the document does (`supported`, 1.0 when it states none), and,
    given the full cache's summary, unigram precision/recall/F1 against it (`agreement_f1`)."""
    doc_nums = {_norm_num(m.group(0)) for m in _NUM.finditer(document)}
    low = document.lower()
    stated = claims(summary)
    unsupported = [c for c in stated
                   if (_norm_num(c) not in doc_nums if _NUM.fullmatch(c) else c.lower() not in low)]
    out = {"claims": stated, "unsupported": unsupported,
           "supported": 1.0 if not stated else 1 - len(unsupported) / len(stated)}
    if full_summary is not None:
        a = [w.lower() for w in _WORD.findall(summary)]
        b = [w.lower() for w in _WORD.findall(full_summary)]
        common = sum(min(a.count(w), b.count(w)) for w in set(a))
        p = common / len(a) if a else 0.0
        r = common / len(b) if b else 0.0
        out["agreement_f1"] = 2 * p * r / (p + r) if p + r else 0.0
    return out
