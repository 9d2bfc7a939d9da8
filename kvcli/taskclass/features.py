"""Text -> sparse binary n-gram features for the WindowKV task classifier (shared by training and inference).

Model-independent on purpose: the policy registry resolves `task=auto` before any model is loaded, and
the same instruction must give the same task on every model and in both engines.
"""
from __future__ import annotations

import re
import unicodedata

# The paper's BERT sees the first and last 256 tokens of the prompt; we do the same with words, so a
# pasted long prompt is classified on its head (task framing) and tail (the question) only.
HEAD_WORDS = 256
TAIL_WORDS = 256

# Latin/Cyrillic/... words (apostrophes inside), digit runs, single CJK characters (no spaces to split on),
# and the punctuation that carries task framing ("Answer:", "Type:", "?", code braces).
_TOKEN = re.compile(r"[^\W\d_]+(?:'[^\W\d_]+)?|\d+"
                    r"|[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]|[?:{}();=\[\]#]")
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")


def normalize(text: str) -> str:
    return unicodedata.normalize("NFKC", text).lower()


def _split_words(text: str) -> list[str]:
    words = text.split()
    if len(words) > HEAD_WORDS + TAIL_WORDS:
        words = words[:HEAD_WORDS] + words[-TAIL_WORDS:]
    return words


def tokens(text: str) -> list[str]:
    """Word-level tokens of the (head + tail of the) text, lower-cased, digits collapsed to '0'."""
    out = []
    for t in _TOKEN.findall(normalize(" ".join(_split_words(text)))):
        out.append("0" if t.isdigit() else t)
    return out


def word_features(toks: list[str]) -> set[str]:
    """Unigrams, bigrams (with start/end markers) and the first word: the opening verb or wh-word is the
    strongest single cue ("summarize ..." vs "who ...")."""
    feats = {f"w:{t}" for t in toks}
    seq = ["<s>"] + toks + ["</s>"]
    feats.update(f"b:{a} {b}" for a, b in zip(seq, seq[1:]))
    if toks:
        feats.add(f"first:{toks[0]}")
    return feats


def char_features(toks: list[str], lo: int = 3, hi: int = 5) -> set[str]:
    """Character n-grams inside each padded word (catches inflections: summar-ize/-ise/-y, complet-e/-ion);
    CJK text has no word boundaries, so its characters are joined into runs first."""
    feats: set[str] = set()
    words, run = [], ""
    for t in toks:
        if _CJK.fullmatch(t):
            run += t
            continue
        if run:
            words.append(run)
            run = ""
        if t.isalpha():
            words.append(t)
    if run:
        words.append(run)
    for w in words:
        padded = f" {w} "
        for n in range(lo, hi + 1):
            feats.update(f"c:{padded[i:i + n]}" for i in range(len(padded) - n + 1))
    return feats


FEATURE_SETS = ("words", "chars", "words+chars")


def featurize(text: str, kind: str = "words+chars") -> set[str]:
    toks = tokens(text)
    if kind == "words":
        return word_features(toks)
    if kind == "chars":
        return char_features(toks)
    if kind == "words+chars":
        return word_features(toks) | char_features(toks)
    raise ValueError(f"unknown feature set {kind}")
