"""Where an answer came from: the passages of the document its tokens attended to, ranked.

After an answer is decoded, its tokens are prefilled again into the same (compressed) sequence with the window
observation armed over all of them (`answer_attention`: the answer rolled back, re-decoded in one batch, so the cache
and the last logits are as before): the engine sums, per (layer, query head, slot), the attention probability the
answer's queries gave each cell. The slots are mapped to the original positions of the entries they hold (the
kept entries of a compressed sequence keep theirs; engines.slot_origins), summed over heads and over the upper half of
the layers (the lower ones attend by position and to the attention sinks, and point at the source less often:
docs/results/citations.md), and each position is mapped to characters of the document through the tokenizer's pieces
(`token_offsets`), then to a passage: a line, or a sentence of a long line (`passages`). Passages are ranked by the
attention their tokens got (the sum), and each is named by its page, chapter and section (`Document.where`), its line
range and a short quote.

What it costs: one prefill of the answer's tokens (a few dozen) over the kept cells, with the observation armed.
A sequence whose entries were re-indexed (a document read in bounded chunks: the kept entries got compact positions
again, kvcli/drivers/chunked.py) no longer knows its entries' original positions by itself. Chat's bounded form (a
book: stored chunks streamed per question, those the block index chose) follows them through every chunk it puts
back and every compaction (kvcli/drivers/reselect_bounded.py `Origins`), so its answers are cited as the exact form's
are, from the entries kept of the chunks streamed for the question (a chunk not streamed cannot be cited); `kvcli run`
of a document read in chunks follows them through its read the same way (kvcli/drivers/chunked.py `FollowOrigins`);
elsewhere (a chat compressed once from a read in chunks, a .kvc file of one) `cite` returns no passage and says why
(`Citations.note`).
"""
from __future__ import annotations

import bisect
import re
import time
from dataclasses import dataclass, field

import numpy as np

from kvcli import engines
from kvcli.doc_formats import Document, convert
from kvcli.errors import KvcliError
from kvcli.planning.formats import MAX_WINDOWS

TOP = 3                  # passages cited
QUOTE_CHARS = 100        # a quote's length at most
PASSAGE_MAX_CHARS = 240  # a longer line is cut into sentences (then into pieces of at most this)
LAYERS_FROM = 0.5        # the layers summed: from this fraction of the depth on (docs/results/citations.md)
OBS_BYTES = 256 << 20    # at most this many bytes of window sums are read back
_SENTENCE_END = re.compile(r"(?<=[.!?;:])[\"')\]]*\s+")


@dataclass(frozen=True)
class Citation:
    """One cited passage: characters [start, end) of the document's text, lines first..last (1-based), where it lies
    (kind -> label: page, chapter, section, document), its share of the answer's attention on the document, a quote."""

    rank: int
    score: float
    start: int
    end: int
    first_line: int
    last_line: int
    where: dict
    quote: str

    def lines(self) -> str:
        return f"line {self.first_line}" if self.first_line == self.last_line else \
            f"lines {self.first_line}-{self.last_line}"

    def label(self) -> str:
        """'page 3, lines 12-13' / 'chapter "Tides", section "Ice", line 40' / 'line 7'."""
        parts = []
        for kind in ("document", "page", "chapter", "section"):
            if kind in self.where:
                lb = self.where[kind]
                parts.append(f"page {lb}" if kind == "page" else lb if kind == "document" else f'{kind} "{lb}"')
        return ", ".join(parts + [self.lines()])

    def as_json(self) -> dict:
        return {"rank": self.rank, "score": round(self.score, 4), "lines": [self.first_line, self.last_line],
                **{k: self.where.get(k) for k in ("page", "chapter", "section", "document") if k in self.where},
                "start": self.start, "end": self.end, "quote": self.quote}


@dataclass
class Citations:
    """The passages of one answer, best first; `note` says why there are none where the engine cannot tell."""

    passages: list[Citation] = field(default_factory=list)
    note: str | None = None
    seconds: float = 0.0

    def as_json(self) -> list[dict]:
        return [c.as_json() for c in self.passages]

    def lines(self) -> list[str]:
        """What `--cite` prints under the answer."""
        if not self.passages:
            return [f"[no citations: {self.note}]"] if self.note else []
        return [f"[{c.rank}] {c.label()} ({c.score:.0%}): \"{c.quote}\"" for c in self.passages]


# ------------------------------------------------------------------------------------------ text
def passages(text: str) -> list[tuple[int, int]]:
    """The passages of a text as [start, end) character spans: its non-blank lines, a line longer than
    PASSAGE_MAX_CHARS cut at sentence ends (and a sentence still longer into pieces of that length)."""
    out = []
    for m in re.finditer(r"[^\n]+", text):
        s, e = m.start(), m.end()
        line = m.group()
        if not line.strip():
            continue
        lead = len(line) - len(line.lstrip())
        s += lead
        e -= len(line) - len(line.rstrip())
        if e - s <= PASSAGE_MAX_CHARS:
            out.append((s, e))
            continue
        cuts = [s] + [s + lead + x.end() for x in _SENTENCE_END.finditer(line.strip())] + [e]
        for a, b in zip(cuts, cuts[1:]):
            while b - a > PASSAGE_MAX_CHARS:
                out.append((a, a + PASSAGE_MAX_CHARS))
                a += PASSAGE_MAX_CHARS
            if text[a:b].strip():
                out.append((a, b - (len(text[a:b]) - len(text[a:b].rstrip()))))
    return out


def line_of(text: str, line_starts: list[int], offset: int) -> int:
    """The 1-based line of character `offset` (line_starts: each line's first character)."""
    return bisect.bisect_right(line_starts, offset)


def quote(text: str, start: int, end: int, peak: int | None = None) -> str:
    """The passage's text on one line, at most QUOTE_CHARS, cut around `peak` (a character) when longer."""
    s = " ".join(text[start:end].split())
    if len(s) <= QUOTE_CHARS:
        return s
    at = 0 if peak is None else len(" ".join(text[start:max(start, peak)].split()))
    a = max(0, min(at - QUOTE_CHARS // 3, len(s) - QUOTE_CHARS))
    cut = s[a:a + QUOTE_CHARS]
    return ("..." if a else "") + cut.strip() + ("..." if a + QUOTE_CHARS < len(s) else "")


# ------------------------------------------------------------------------------------------ tokens
def token_pieces(session, tokens: list[int]) -> list[bytes] | None:
    """Each token's bytes as the tokenizer wrote it, special tokens as their text (engines.token_pieces); None for
    an engine that does not cite (engines.cites)."""
    return engines.token_pieces(session, tokens) if engines.cites(session) else None


def token_offsets(pieces: list[bytes], text: str) -> np.ndarray:
    """The character of `text` each token starts at (-1 where it cannot be placed), from the tokens' pieces: their
    concatenation is the text's UTF-8 bytes for a byte-level BPE; otherwise (SentencePiece's leading space, a
    normalised piece) each piece is looked for from where the previous one ended."""
    data = text.encode("utf-8")
    char_of = np.zeros(len(data) + 1, np.int64)   # byte offset -> character offset
    pos = 0
    for i, ch in enumerate(text):
        n = len(ch.encode("utf-8"))
        char_of[pos:pos + n] = i
        pos += n
    char_of[pos] = len(text)
    out = np.full(len(pieces), -1, np.int64)
    at = 0
    for i, p in enumerate(pieces):
        if not p:
            continue
        if data.startswith(p, at):
            out[i] = char_of[at]
            at += len(p)
            continue
        q = p.lstrip(b" ")
        j = data.find(q, at, at + len(q) + 16) if q else -1
        if j >= 0:
            out[i] = char_of[j]
            at = j + len(q)
    return out


# ------------------------------------------------------------------------------------------ attention
def slot_origins(session, seq: int) -> list[list[np.ndarray]]:
    """Per (layer, KV head), the original position of the entry each slot of `seq` holds (-1: a dead slot)."""
    return engines.slot_origins(session, seq)


def segments(weights: list[float], most: int) -> list[tuple[int, int, float]]:
    """The answer's tokens as at most `most` runs (start, end, weight): runs of equal weight, or, when there are more,
    `most` equal parts weighted by their tokens' mean weight."""
    n = len(weights)
    runs = [i for i in range(n) if i == 0 or weights[i] != weights[i - 1]] + [n]
    if len(runs) - 1 <= most:
        return [(a, b, float(weights[a])) for a, b in zip(runs, runs[1:])]
    cuts = sorted({round(i * n / most) for i in range(most)} | {n})
    return [(a, b, float(np.mean(weights[a:b]))) for a, b in zip(cuts, cuts[1:])]


def answer_attention(session, seq: int, answer_tokens: list[int], weights: list[float] | None = None,
                     origins=None) -> tuple[np.ndarray, np.ndarray]:
    """([n_layer, tokens read] the attention the answer's tokens gave each original position, per layer, each token's
    share weighted by `weights` (default 1), the same unweighted). The answer is the last len(answer_tokens) tokens
    of `seq`: they are rolled back and prefilled again in one batch with the window observation armed over them,
    which leaves the cache holding them again, the last logits theirs, and the sequence's bookkeeping as it was. The
    engine sums a window's queries: one window per run of equal weight (`segments`, at most MAX_WINDOWS, fewer where
    the sums of a long sequence would pass OBS_BYTES), each run's attention the difference of two windows.
    `origins` (a re-indexed sequence's: reselect_bounded.Origins): the prompt token each slot holds, the positions
    then those of `origins.tokens` (its length the width)."""
    n = len(answer_tokens)
    st = session.seq(seq)
    info = session.info
    most = max(1, min(MAX_WINDOWS, OBS_BYTES // max(1, info.n_layer * info.n_head * 4 * (st.cells + n))))
    segs = segments(list(weights) if weights is not None else [1.0] * n, most)
    windows = sorted({n - a for a, _, _ in segs})
    prompt_tokens, timings = st.prompt_tokens, dict(st.timings)
    session.rollback(seq, n)
    try:
        obs = session.prefill(list(answer_tokens), seq=seq, observe=("window",), window=tuple(windows))
    finally:
        st.prompt_tokens, st.timings = prompt_tokens, timings
    by_len = dict(zip(obs.windows, obs.window_sums))          # window length -> [n_layer, n_head, slots]
    full = by_len[n]
    weighted = np.zeros_like(full)
    for a, b, w in segs:
        if w:
            weighted += w * (by_len[n - a] - (by_len[n - b] if b < n else 0.0))
    group = info.n_head // info.n_head_kv
    width = st.tokens_read if origins is None else len(origins.tokens)
    origins = slot_origins(session, seq) if origins is None else origins.slot_origins(session, seq)
    out = np.zeros((2, info.n_layer, width), np.float64)
    for il in range(info.n_layer):
        for h in range(info.n_head_kv):
            pos = np.asarray(origins[il][h])
            live = (pos >= 0) & (pos < out.shape[2])
            for k, sums in enumerate((weighted, full)):
                w = sums[il, h * group:(h + 1) * group].sum(0)
                np.add.at(out[k, il], pos[live], w[live])
    return out[0], out[1]


def novelty_weights(session, answer_tokens: list[int], question: str | None) -> list[float] | None:
    """1 for an answer token of a word the question does not hold, 0 for one of a word it does ("The emergency
    channel of the north ridge is 2172.": the number) and for punctuation and spaces: the words an answer copies
    from its question attend to every passage that holds them. None (every token counts) without a question, or when
    every token would get 0."""
    if not question:
        return None
    pieces = token_pieces(session, answer_tokens)
    if pieces is None:
        return None
    asked = {w.lower() for w in re.findall(r"\w+", question)}
    text = b"".join(pieces).decode("utf-8", "replace")
    words = [(m.start(), m.end(), m.group().lower()) for m in re.finditer(r"\w+", text)]
    out, at, k = [], 0, 0
    for p in pieces:
        piece = p.decode("utf-8", "replace")
        lead = len(piece) - len(piece.lstrip())
        c, at = at + lead, at + len(piece)
        while k < len(words) and words[k][1] <= c:
            k += 1
        inside = k < len(words) and words[k][0] <= c < words[k][1] and piece.strip() != ""
        out.append(0.0 if not inside or words[k][2] in asked else 1.0)
    return out if any(out) else None


def layer_weights(n_layer: int) -> np.ndarray:
    """Which layers' attention counts (1) and which not (0): the upper half."""
    w = np.zeros(n_layer)
    w[int(n_layer * LAYERS_FROM):] = 1.0
    return w


# ------------------------------------------------------------------------------------------ passages
def rank(doc: Document, prompt_text: str, prompt_tokens: list[int], pieces: list[bytes] | None,
         position_scores: np.ndarray, top: int = TOP) -> list[Citation]:
    """The `top` passages of `doc` by the attention their tokens got (`position_scores`, per position of
    `prompt_tokens`, whose text `prompt_text` holds the document's stripped text once)."""
    body = doc.text.strip()
    at = prompt_text.find(body) if body else -1
    if at < 0 or pieces is None:
        return []
    lead = len(doc.text) - len(doc.text.lstrip())
    offs = token_offsets(pieces, prompt_text)
    spans = passages(doc.text)
    if not spans:
        return []
    starts = [s for s, _ in spans]
    score = np.zeros(len(spans))
    peak = np.full(len(spans), -1, np.int64)
    best = np.zeros(len(spans))
    n = min(len(prompt_tokens), len(offs), len(position_scores))
    for i in range(n):
        c = int(offs[i])
        if c < at or c >= at + len(body) or position_scores[i] <= 0:
            continue
        end = int(offs[i + 1]) if i + 1 < len(offs) and offs[i + 1] > c else c + 1
        piece = prompt_text[c:end]
        if not piece.strip():        # a whitespace token (a line break): no passage's
            continue
        d = c + (len(piece) - len(piece.lstrip())) - at + lead
        k = bisect.bisect_right(starts, d) - 1
        if k < 0 or d >= spans[k][1]:
            continue
        v = float(position_scores[i])
        score[k] += v
        if v > best[k]:
            best[k], peak[k] = v, d
    total = score.sum()
    if total <= 0:
        return []
    line_starts = [0] + [m.end() for m in re.finditer("\n", doc.text)]
    out = []
    for r, k in enumerate(np.argsort(-score, kind="stable")[:top]):
        if score[k] <= 0:
            break
        s, e = spans[k]
        where = {kind: b.label for kind, b in doc.where(s).items()}
        out.append(Citation(rank=r + 1, score=float(score[k] / total), start=s, end=e,
                            first_line=line_of(doc.text, line_starts, s),
                            last_line=line_of(doc.text, line_starts, e - 1),
                            where=where, quote=quote(doc.text, s, e, int(peak[k]))))
    return out


def cite(session, seq: int, answer_tokens: list[int], *, prompt_text: str, prompt_tokens: list[int],
         document: Document | str, question: str | None = None, top: int = TOP, origins=None) -> Citations:
    """The passages of `document` the answer (the last len(answer_tokens) tokens of `seq`) was decoded from, best
    first. `prompt_text` / `prompt_tokens`: the text and tokens whose positions the sequence's entries hold (the
    document's part of them at least). `question`: the answer's tokens of its words count for nothing
    (`novelty_weights`). `origins`: a re-indexed sequence's entries' prompt tokens (chat's bounded form,
    reselect_bounded.Origins; `prompt_tokens` are then its tokens)."""
    t0 = time.perf_counter()
    doc = document if isinstance(document, Document) else Document(document, "text")
    if not answer_tokens:
        return Citations(note="the answer is empty")
    if not engines.cites(session):
        return Citations(note="the reference engine does not cite")
    if session.seq(seq).reindexed and origins is None:
        return Citations(note="the document was read in chunks whose kept entries were given new positions, so their "
                              "place in the document is not known (--chunk 0 reads a document that fits the context "
                              "in one go)")
    att, _ = answer_attention(session, seq, answer_tokens, novelty_weights(session, answer_tokens, question), origins)
    scores = layer_weights(att.shape[0]) @ att
    out = Citations(rank(doc, prompt_text, prompt_tokens, token_pieces(session, prompt_tokens), scores, top))
    if not out.passages:
        out.note = "the answer did not attend to the document"
    out.seconds = time.perf_counter() - t0
    return out


def cite_turn(conv, gen, document: Document | str | None = None, top: int = TOP) -> Citations:
    """The citations of a conversation's last answer (kvcli/apps/chat.py's Conversation, `gen` its Generation): the
    sequence holds the answer's tokens last; the document's entries hold the positions of the conversation's prefix
    (`prefix_text`, `prefix_tokens`: the template's head and the document, in every mode) or, re-selected in bounded
    chunks, those of the question's whole prompt, followed by the re-selection (`Origins`)."""
    if gen.stopped == "interrupted":
        return Citations(note="the answer was interrupted")
    source = document if document is not None else getattr(conv, "source", None) or conv.document
    question = conv.turns[-1].question if conv.turns else None
    origins = getattr(getattr(conv, "last_reselection", None), "origins", None)
    if origins is not None:
        pieces = token_pieces(conv.session, origins.tokens)
        if pieces is None:
            return Citations(note="the reference engine does not cite")
        text = b"".join(pieces).decode("utf-8", "replace")
        return cite(conv.session, conv.seq, gen.tokens, prompt_text=text, prompt_tokens=origins.tokens,
                    question=question, document=source, top=top, origins=origins)
    return cite(conv.session, conv.seq, gen.tokens, prompt_text=conv.prefix_text(), prompt_tokens=conv.prefix_tokens,
                question=question,
                document=source, top=top)


_ROLE_LINE = re.compile(r"\A\s*(system|user|assistant|developer|human|model)\s*\n", re.I)


def prompt_document(session, prompt_tokens: list[int]) -> tuple[str, Document, str | None] | None:
    """A request's prompt as text (its tokens' pieces, special tokens included) and the document in it: the longest
    stretch of text between two control tokens (a chat template's message markers), less a leading role line (and
    its last line, the question, when it is the last message), with its Markdown headings as sections. None for an
    engine without llama.cpp's vocabulary."""
    pieces = token_pieces(session, prompt_tokens)
    if pieces is None:
        return None
    text, spans, start = "", [], 0
    for control, p in zip(engines.control_tokens(session, prompt_tokens), pieces):
        piece = p.decode("utf-8", "replace")
        if control:
            spans.append((start, len(text)))
            start = len(text) + len(piece)
        text += piece
    spans.append((start, len(text)))
    s, e = max(spans, key=lambda x: x[1] - x[0])
    body, question = text[s:e], None
    m = _ROLE_LINE.match(body)
    if m:
        body = body[m.end():]
    if not any(_ROLE_LINE.sub("", text[a:b], count=1).strip() for a, b in spans if a > s):
        # the last message: its last line is the question (as kvcli serve takes it), not the document's
        body = body.rstrip()
        if "\n" in body:
            body, question = body[:body.rfind("\n") + 1], body[body.rfind("\n") + 1:]
    try:
        doc = convert(body.encode("utf-8"), "message", "markdown")
    except KvcliError:   # an empty message (or not UTF-8 text): plain text, no sections
        doc = Document(body, "text", "message")
    return text, doc, question


def cite_prompt(session, seq: int, answer_tokens: list[int], prompt_tokens: list[int], top: int = TOP) -> Citations:
    """`kvcli serve`'s citations: the passages of the request's document (`prompt_document`: its longest message)
    that the answer (the last len(answer_tokens) tokens of `seq`, decoded after `prompt_tokens`) came from, lines
    counted in that message."""
    found = prompt_document(session, prompt_tokens)
    if found is None:
        return Citations(note="the reference engine does not cite")
    text, doc, question = found
    if not doc.text.strip():
        return Citations(note="the prompt holds no document")
    return cite(session, seq, answer_tokens, prompt_text=text, prompt_tokens=prompt_tokens, document=doc,
                question=question, top=top)
