"""Sampling and the decode loop, shared by both engines (they only need logits() and step()).

Tokens are picked by llama.cpp's sampler chain (`llama_sampler_*`, the samplers llama-cli and
llama-server use): repetition penalties, DRY, then top-k, top-p, min-p, temperature and a seeded
distribution, or greedy at temperature 0. Plain greedy decoding (temperature 0, no penalty) is
`argmax` of the logits, in both engines: the first of equal maxima, as llama.cpp's greedy sampler.
Penalties see the answer being generated (not the prompt), and start afresh for every answer.
`generate()` decodes one answer to its end; `Decoding` is the same loop a token at a time, for a caller that
decodes several sequences' tokens in one batch (kvcli serve's parallel decode).
"""
from __future__ import annotations

import codecs
import ctypes
import math
import time
from dataclasses import dataclass, field, fields, replace

import numpy as np

from kvcli.errors import ContextFull, KvcliError
from kvcli.native import load_llama_cpp, signals_deferred

DRY_BREAKERS = ("\n", ":", "\"", "*")      # llama.cpp's default DRY sequence breakers


@dataclass(frozen=True)
class Sampling:
    """Sampling settings, named as in llama.cpp (llama-cli --help); `validate()` refuses bad values in one line.

    The defaults stop runaway repetition (a DRY penalty on repeats longer than dry_allowed_length tokens)
    and leave everything else as plain greedy decoding; docs/results.md shows they keep retrieval."""

    temperature: float = 0.0        # 0 = greedy
    top_k: int = 40                 # <= 0: whole vocabulary
    top_p: float = 0.95             # 1 = off
    min_p: float = 0.05             # 0 = off
    seed: int = 0
    repeat_penalty: float = 1.0     # 1 = off
    repeat_last_n: int = 64         # -1 = the whole answer
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    dry_multiplier: float = 0.8     # 0 = off
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1    # -1 = the whole answer

    # (lowest, highest) accepted: flag names are the field names with '-' for '_'
    RANGES = {"temperature": (0.0, 10.0), "top_k": (0, 1 << 20), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0),
              "seed": (0, 2 ** 32 - 2), "repeat_penalty": (0.01, 10.0), "repeat_last_n": (-1, 1 << 20),
              "presence_penalty": (-10.0, 10.0), "frequency_penalty": (-10.0, 10.0),
              "dry_multiplier": (0.0, 100.0), "dry_base": (1.0, 100.0), "dry_allowed_length": (1, 1 << 20),
              "dry_penalty_last_n": (-1, 1 << 20)}

    def validate(self) -> "Sampling":
        for f in fields(self):
            v = getattr(self, f.name)
            lo, hi = self.RANGES[f.name]
            flag = "--" + f.name.replace("_", "-")
            if isinstance(v, float) and not math.isfinite(v):
                raise KvcliError(f"{flag}: {v} is not a finite number")
            if not lo <= v <= hi:
                raise KvcliError(f"{flag}: {v} is out of range [{lo}, {hi}]")
        return self

    @property
    def penalised(self) -> bool:
        return (self.repeat_penalty != 1.0 and self.repeat_last_n != 0) or self.presence_penalty != 0 \
            or self.frequency_penalty != 0 or (self.dry_multiplier > 0 and self.dry_penalty_last_n != 0)

    @classmethod
    def greedy(cls) -> "Sampling":
        """Plain argmax: no penalty (what bench, eval and check measure)."""
        return cls(repeat_penalty=1.0, dry_multiplier=0.0)


_TOKEN_DATA = np.dtype([("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])


class TokenPicker:
    """One answer's llama.cpp sampler chain (or argmax): call it on logits, it returns the token and
    remembers it for the penalties."""

    def __init__(self, s: Sampling, session, max_tokens: int):
        self.chain = None
        if s.temperature <= 0 and not s.penalised:
            return                                   # plain greedy: argmax, bit-identical in both engines
        self.L = L = load_llama_cpp()
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        self.chain = chain
        whole = max(1, int(max_tokens))              # -1: the whole answer
        last_n = whole if s.repeat_last_n < 0 else s.repeat_last_n
        add = lambda smpl: L.llama_sampler_chain_add(chain, smpl)  # noqa: E731 (the chain owns it)
        add(L.llama_sampler_init_penalties(int(session.n_vocab), last_n, s.repeat_penalty, s.frequency_penalty,
                                           s.presence_penalty))
        if s.dry_multiplier > 0:
            breakers = (ctypes.c_char_p * len(DRY_BREAKERS))(*(b.encode() for b in DRY_BREAKERS))
            add(L.llama_sampler_init_dry(vocab_of(session), s.dry_multiplier, s.dry_base, s.dry_allowed_length,
                                         whole if s.dry_penalty_last_n < 0 else s.dry_penalty_last_n,
                                         breakers, len(DRY_BREAKERS)))
        if s.temperature <= 0:
            add(L.llama_sampler_init_greedy())
        else:
            add(L.llama_sampler_init_top_k(s.top_k))
            add(L.llama_sampler_init_top_p(s.top_p, 1))
            add(L.llama_sampler_init_min_p(s.min_p, 1))
            add(L.llama_sampler_init_temp(s.temperature))
            add(L.llama_sampler_init_dist(s.seed))
        self.data = None

    def __call__(self, logits: np.ndarray) -> int:
        if self.chain is None:
            return int(np.argmax(logits))
        if self.data is None or self.data.size != logits.size:
            self.data = np.zeros(logits.size, dtype=_TOKEN_DATA)
        d = self.data
        d["id"] = np.arange(logits.size, dtype=np.int32)
        d["logit"] = logits
        d["p"] = 0.0
        arr = self.L.llama_token_data_array(
            data=d.ctypes.data_as(ctypes.POINTER(self.L.llama_token_data)), size=d.size, selected=-1, sorted=False)
        self.L.llama_sampler_apply(self.chain, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise KvcliError("llama.cpp's sampler chain selected no token")
        tok = int(ctypes.cast(arr.data, ctypes.POINTER(self.L.llama_token_data))[arr.selected].id)
        self.L.llama_sampler_accept(self.chain, tok)
        return tok

    def close(self) -> None:
        if self.chain is not None:
            self.L.llama_sampler_free(self.chain)
            self.chain = None

    __del__ = close


_VOCABS: dict[str, object] = {}


def vocab_of(session):
    """The llama_vocab DRY needs: the native session's, or (reference engine) a vocab-only load of its GGUF."""
    if getattr(session, "vocab", None) is not None:
        return session.vocab
    path = str(session.model_path)
    if path not in _VOCABS:
        L = load_llama_cpp()
        params = L.llama_model_default_params()
        params.vocab_only = True
        with signals_deferred():
            model = L.llama_model_load_from_file(path.encode(), params)
        if not model:
            raise KvcliError(f"llama.cpp could not read the vocabulary of {path}")
        _VOCABS[path] = (model, L.llama_model_get_vocab(model))
    return _VOCABS[path][1]


class Sampler:
    """Sampling settings for every answer of a run or chat (a fresh sampler chain per answer)."""

    def __init__(self, sampling: Sampling | None = None, **changes):
        """Sampler() is plain greedy; Sampler(Sampling()) has the CLI's defaults; keywords change fields."""
        self.sampling = replace(sampling or Sampling.greedy(), **changes).validate()

    def start(self, session, max_tokens: int) -> TokenPicker:
        return TokenPicker(self.sampling, session, max_tokens)


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    stopped: str = "length"     # "eog", "length", "interrupted", "context_full"
    decode_s: float = 0.0

    @property
    def decode_tok_s(self) -> float | None:
        return len(self.tokens) / self.decode_s if self.decode_s > 0 and self.tokens else None


def generate(session, max_tokens: int, sampler: Sampler | None = None, seq: int = 0, on_text=None,
             ignore_eos: bool = False) -> Generation:
    """Sample from the logits already in `seq`, feed each token back, stream text to on_text.

    `ignore_eos` (llama-server's request field of that name): an end-of-generation token is never picked, the
    answer runs to max_tokens (benchmarks compare fixed answer lengths).

    Ctrl-C stops cleanly: the tokens so far are kept (stopped = "interrupted").
    """
    pick = (sampler or Sampler()).start(session, max_tokens)
    out = Generation()
    dec = codecs.getincrementaldecoder("utf-8")("replace")
    pos0 = session.seq(seq).next_pos
    shown = 0   # tokens whose text went to on_text
    t0 = time.perf_counter()
    try:
        for _ in range(max_tokens):
            logits = session.logits(seq)
            tok = pick(logits)
            if ignore_eos and session.is_eog(tok):
                logits = np.array(logits, dtype=np.float32, copy=True)
                while session.is_eog(tok):   # the picked one masked, picked again
                    logits[tok] = -np.inf
                    tok = pick(logits)
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
    finally:
        pick.close()
    out.decode_s = time.perf_counter() - t0
    _show(out, dec, b"", on_text, final=True)
    return out


def _show(out: Generation, dec, data: bytes, on_text, final: bool = False) -> None:
    piece = dec.decode(data, final=final)
    if piece:
        out.text += piece
        if on_text:
            on_text(piece)


class Decoding:
    """One answer decoded a token at a time by a caller that decodes several sequences in one batch (kvcli serve's
    parallel decode, kvcli/apps/serve_decode.py): `next()` picks the sequence's next token from its logits (None: the
    answer has ended, at an end-of-generation token or at max_tokens), the caller decodes it together with the other
    sequences' tokens (`session.step({seq: tok, ...})`), then `took(tok)` adds it to the answer and streams its text.
    The picks are generate()'s, token for token: one sequence stepped alone decodes what generate() decodes.

    on_text may raise KeyboardInterrupt (a stop string, a client gone): the answer ends "interrupted" with the token
    kept (it is in the cache), as generate() keeps it. `end(reason)` ends it otherwise ("context_full", or the
    caller's own reason); `result` is the Generation once ended."""

    def __init__(self, session, max_tokens: int, sampler: Sampler | None = None, seq: int = 0, on_text=None,
                 ignore_eos: bool = False):
        self.session, self.max_tokens, self.seq = session, max_tokens, seq
        self.on_text, self.ignore_eos = on_text, ignore_eos
        self.pick = (sampler or Sampler()).start(session, max_tokens)
        self.out = Generation()
        self.dec = codecs.getincrementaldecoder("utf-8")("replace")
        self.t0 = time.perf_counter()
        self.result: Generation | None = None

    @property
    def tokens(self) -> list[int]:
        return self.out.tokens

    def next(self) -> int | None:
        """The next token to decode, or None when the answer has ended (eog or max_tokens)."""
        if self.result is not None:
            return None
        if len(self.out.tokens) >= self.max_tokens:
            self.end("length")
            return None
        logits = self.session.logits(self.seq)
        tok = self.pick(logits)
        if self.ignore_eos and self.session.is_eog(tok):
            logits = np.array(logits, dtype=np.float32, copy=True)
            while self.session.is_eog(tok):   # the picked one masked, picked again
                logits[tok] = -np.inf
                tok = self.pick(logits)
        if self.session.is_eog(tok):
            self.end("eog")
            return None
        return tok

    def took(self, tok: int) -> None:
        """`tok` is decoded into the sequence: it joins the answer and its text goes out."""
        self.out.tokens.append(tok)
        try:
            _show(self.out, self.dec, self.session.token_bytes(tok), self.on_text)
        except KeyboardInterrupt:
            self.end("interrupted")

    def end(self, stopped: str) -> Generation:
        """End the answer (once): the sampler freed, the decoder flushed."""
        if self.result is None:
            self.out.stopped = stopped
            self.pick.close()
            self.out.decode_s = time.perf_counter() - self.t0
            try:
                _show(self.out, self.dec, b"", self.on_text, final=True)
            except KeyboardInterrupt:   # a stop string completed by the flushed bytes: the answer ends there anyway
                pass
            self.result = self.out
        return self.result
