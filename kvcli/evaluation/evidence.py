"""Is a question's answer still in the cache it is answered from? (issue #63, the bounded form)

A corpus question's answer is text the document holds once (kvcli/evaluation/questions.py): the blanked number or
name of a fact, copy or combine question, the heading of a structure question. After a re-selection the cache holds,
per layer and KV head, some of the prompt's tokens (reselect_bounded.Origins). `answer_kept` is the share of the
answer's tokens (where the document writes it) that a layer x KV-head cache holds, averaged over the caches and
over the question's answers (a combine question has two): 1.0 where every head kept every token of it, 0.0 where
none kept any. (Qwen writes a number digit by digit: one digit kept of "3115" is a quarter of it.)

It reads what a compression kept, not what a model made of it: on the 0.5b and 1.5b models the bounded form's
answers are too few to compare forms by (every chunk streamed answers 1 and 0 of 27 held-out questions), while
whether the answer's tokens were kept is measured for every question. A head that keeps the answer is not a head
that attends to it when decoding; the share is a necessary condition of an answer, not a prediction of one.
"""
from __future__ import annotations

import numpy as np

from kvcli.citations import token_offsets, token_pieces
from kvcli.evaluation.tasks import render


def answer_chars(q, text: str) -> list[tuple[int, int]]:
    """(start, end) in the document's characters of each of the question's answers where the document writes it
    (the evidence the question was made from); [] for a summary or where an answer cannot be found there."""
    if q.kind == "summary" or not q.answers:
        return []
    n = max(1, len(text))
    if q.kind == "structure":   # the heading line the quoted sentence sits under
        heading = q.meta.get("heading") or q.answers[0]
        at = text.rfind(heading, 0, round((q.depth or 0) * n) + 1)
        return [(at, at + len(heading))] if at >= 0 else []
    depths = q.meta.get("depths") or [q.depth] * len(q.answers)
    out = []
    for a, d in zip(q.answers, depths):
        at = text.find(a, max(0, round((d or 0) * n) - 1))
        if at >= 0:
            out.append((at, at + len(a)))
    return out


def answer_tokens(q, text: str, prompt_text: str, pieces: list[bytes]) -> list[np.ndarray]:
    """For each answer of `q` found in the document `text`, the indices of the prompt's tokens (their `pieces`, of
    `prompt_text`, which holds the document stripped) that overlap it."""
    doc = text.strip()
    lead = len(text) - len(text.lstrip())
    start = prompt_text.find(doc[:200])
    if start < 0:
        return []
    offs = token_offsets(pieces, prompt_text)
    placed = np.flatnonzero(offs >= 0)
    begins = offs[placed]
    ends = np.append(begins[1:], len(prompt_text))
    out = []
    for a, b in answer_chars(q, text):
        a, b = start + a - lead, start + b - lead
        hit = placed[(begins < b) & (ends > a)]
        if hit.size:
            out.append(hit)
    return out


def kept_share(origins: list[list[np.ndarray]], spans: list[np.ndarray]) -> float | None:
    """The share of each span's tokens a (layer, KV head) cache holds (`origins`: per layer and head, the prompt token
    each slot holds, reselect_bounded.Origins.slot_origins), averaged over the caches and the spans; None without
    spans."""
    if not spans:
        return None
    heads = [o for layer in origins for o in layer]
    return float(np.mean([np.mean([np.isin(s, o).mean() for o in heads]) for s in spans]))


def answer_spans(session, q, text: str, prompt: list[int]) -> list[np.ndarray] | None:
    """`answer_tokens` of the question whose prompt is `prompt` (rendered as eval's `render` lays it out: the document
    and the question in one user turn), once per question, for `kept_share` of every form's cache; [] for a summary,
    None for an engine that cannot place its tokens in the text."""
    if q.kind == "summary":
        return []
    pieces = token_pieces(session, prompt)
    if pieces is None:
        return None
    return answer_tokens(q, text, render(session, text, [], q.question), pieces)
