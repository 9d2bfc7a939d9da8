"""Sampling and the decode loop, shared by both engines (they only need logits() and step())."""
from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Sampler:
    """temperature 0 is greedy (the default: answers are reproducible and comparable across policies)."""

    temperature: float = 0.0
    top_k: int = 40
    top_p: float = 0.95
    seed: int = 0
    rng: np.random.Generator = field(init=False)

    def __post_init__(self):
        self.rng = np.random.default_rng(self.seed)

    def __call__(self, logits: np.ndarray) -> int:
        if self.temperature <= 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / self.temperature
        if 0 < self.top_k < z.size:
            cut = np.partition(z, -self.top_k)[-self.top_k]
            z = np.where(z >= cut, z, -np.inf)
        p = np.exp(z - z.max())
        p /= p.sum()
        if self.top_p < 1.0:
            order = np.argsort(-p, kind="stable")
            keep = np.cumsum(p[order]) - p[order] < self.top_p
            mask = np.zeros_like(p, dtype=bool)
            mask[order[keep]] = True
            p = np.where(mask, p, 0.0)
            p /= p.sum()
        return int(self.rng.choice(p.size, p=p))


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stopped: str = "length"     # "eog", "length", "interrupted", "context_full"
    decode_s: float = 0.0

    @property
    def decode_tok_s(self) -> float | None:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 and self.tokens else None


def generate(session, max_tokens: int, sampler: Sampler | None = None, seq: int = 0, on_text=None) -> Generation:
    """Sample from the logits already in `seq`, feed each token back, stream text to on_text.

    Ctrl-C stops cleanly: the tokens so far are kept (stopped = "interrupted").
    """
    from kvcli.native.session import ContextFull  # noqa: PLC0415

    sampler = sampler or Sampler()
    out = Generation()
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    pos0 = session.seq(seq).next_pos
    shown = 0   # tokens whose text went to on_text
    t0 = time.perf_counter()
    try:
        for _ in range(max_tokens):
            tok = sampler(session.logits(seq))
            if session.is_eog(tok):
                out.stopped = "eog"
                break
            out.tokens.append(tok)
            try:
                session.step({seq: tok})
            except ContextFull:
                out.tokens.pop()   # not in the cache: not part of the answer
                out.stopped = "context_full"
                break
            _show(out, dec, session.token_bytes(tok), on_text)
            shown += 1
    except KeyboardInterrupt:
        # the answer is what the cache holds (the session undoes an interrupted step): a token not
        # decoded is dropped, one decoded but not yet shown is shown
        out.stopped = "interrupted"
        out.tokens[:] = out.tokens[:session.seq(seq).next_pos - pos0]
        for tok in out.tokens[shown:]:
            _show(out, dec, session.token_bytes(tok), on_text)
    out.decode_s = time.perf_counter() - t0
    _show(out, dec, b"", on_text, final=True)
    return out


def _show(out: Generation, dec, data: bytes, on_text, final: bool = False) -> None:
    piece = dec.decode(data, final=final)
    if piece:
        out.text += piece
        if on_text:
            on_text(piece)
