"""A conversation compressed once (kvcli/apps/chat.py: the modes): the document is prefilled and compressed, in
chunks when it is longer than the context allows, and every turn is appended after the compressed prefix.

- question-agnostic (`CompressedOnce`, no question yet): the prefix is the document's user turn followed by
  GENERIC_SUFFIX; each question is a new user turn.
- question-aware (`QuestionKnown`, a question is known before compressing): the prefix is the whole first prompt, the
  question after the document in the same user turn, then the assistant header; its first answer is decoded from the
  prefix's logits (`_Primed`).

A .kvc file holds such a conversation (to_kvc, from_kvc).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar

import numpy as np

from kvcli import config, doc_formats, kvc
from kvcli.apps.chat_base import AGNOSTIC, AWARE, ContextFullError, Conversation, Turn, _jsonable, user_content
from kvcli.drivers import compress
from kvcli.drivers.chunked import TURN_ROOM, pad_cells, read_in_float16_note, reading_cache_type
from kvcli.errors import KvcliError
from kvcli.generate import generate
from kvcli.models import resolve_model
from kvcli.engines import ContextFull, SeqSnapshot, cache_state, is_compressed, open_native, set_header
from kvcli.templating import GENERIC_SUFFIX


class _Primed:
    """The session, but whose first logits() are given (a restored or reset prefix has no live logits)."""

    def __init__(self, session, logits: np.ndarray):
        self._session, self._logits = session, logits

    def logits(self, seq: int = 0):
        if self._logits is not None:
            out, self._logits = self._logits, None
            return out.copy()
        return self._session.logits(seq)

    def __getattr__(self, name):
        return getattr(self._session, name)


class CompressedOnce(Conversation, kind="once"):
    """The document compressed once, question-agnostic (no question yet: GENERIC_SUFFIX after it); a question known
    before compressing makes it a `QuestionKnown`."""

    generic_suffix: ClassVar[str | None] = GENERIC_SUFFIX   # what follows the document in the prefix (.kvc metadata)

    @property
    def mode(self) -> str:
        return AGNOSTIC

    def prefix_text(self) -> str:
        return self.fmt.head + user_content(self.document, GENERIC_SUFFIX)

    # ------------------------------------------------------------------ compression
    def compress(self, progress=None, on_cache=None):
        """Prefill the prefix and compress it (kvcli.drivers.compress.prefill_and_compress), in chunks when it is longer
        than the context allows."""
        chunking = self.chunking()
        held = reading_cache_type(self.session.info, self.cache_type) if chunking.chunk else self.cache_type
        if self.session.cache_type != held:   # a quantised cache is read in float16 (chunked.requantises), or back
            self.session.clear()
            self.session.use_cache_type(held)
        if self.session.ctx is not None and self.session.n_ctx < chunking.n_ctx:
            # the context was fitted to an earlier compressed prefix (or a .kvc file): reading needs more
            self.session.clear(self.seq)
            self.session.resize_context(chunking.n_ctx)
        self.ensure_context()
        if chunking.chunk is None and len(self.prefix_tokens) > self.session.n_ctx:
            raise KvcliError(f"the prompt is {len(self.prefix_tokens)} tokens but this context holds "
                             f"{self.session.n_ctx} cells")
        if self.seq in self.session.seqs:
            self.session.clear(self.seq)
        key = self._announce("chunked" if chunking.chunk else "prefill", f"reading it in chunks of {chunking.chunk}"
                             if chunking.chunk else "reading it in one prefill", self.seq)
        t0 = time.perf_counter()
        # the question (aware) is the instruction task-adaptive policies classify; agnostic has none
        self.report = compress.prefill_and_compress(self.session, self.prefix_tokens, self._cfg(self.question),
                                                    seq=self.seq, progress=progress, instruction=self.question,
                                                    chunk=chunking.chunk, cap=chunking.cap, on_cache=on_cache,
                                                    scoring=self.chunk_scoring)
        doc_formats.record_read_speed(key, len(self.prefix_tokens), time.perf_counter() - t0)
        if held != self.cache_type:
            self.report.note = "; ".join(filter(None, (self.report.note, read_in_float16_note(self.cache_type))))
        st = self._st()
        st.cells = self._measured_cells()
        self.reset_mark = (st.next_pos, st.cells)
        self.prefix_logits = self._prefix_logits()
        if self.report.plan is not None:
            set_header(self.session, self.seq, self.policy, int(self.budget), len(self.prefix_tokens))
            self.fit_context()
        self._at_prefix()
        return self.report

    def _prefix_logits(self):
        """What the compressed prefix's logits are kept for: nothing here (each question is prefilled after it)."""
        return None

    def _at_prefix(self) -> None:
        self.tail, self.pending, self.turns = "user", False, []

    def recompress(self, policy: str | None = None, budget: int | None = None, policy_args: dict | None = None,
                   progress=None):
        """Compress the original document again with another policy or budget (the conversation is
        dropped). If that fails or is interrupted, the cache as it was is put back."""
        new_policy, new_budget, new_args = self._new_choice(policy, budget, policy_args)
        # snapshot: the sequence's state (a few MB) with its bookkeeping, and the conversation's fields
        snap, fields = self.session.save_seq(self.seq), dict(self.__dict__)
        self.policy, self.budget, self.policy_args = new_policy, new_budget, dict(new_args)
        try:
            return self.compress(progress)
        except BaseException:
            self.__dict__.update(fields)
            self.session.restore_seq(snap, self.seq)
            raise

    def reset(self) -> None:
        """Back to the compressed document: every turn's cells are removed."""
        pos, cells = self.reset_mark
        self._truncate(pos)
        if self._st().cells != cells:
            raise KvcliError(f"/reset left {self._st().cells} cells, expected the {cells} of the compressed document")
        self._at_prefix()

    def _full_message(self) -> str:
        st = self._st()
        return (f"the context is full ({st.cells} of {self.session.n_ctx} cells, position {st.next_pos} of "
                f"{self.session.n_ctx_train}): /reset goes back to the compressed document")

    def ask(self, question: str, max_tokens: int, sampler=None, on_text=None):
        """Append one user turn and generate the answer; returns the Generation."""
        question = question.strip()
        if not question:
            raise KvcliError("the question is empty")
        st = self._st()
        mark = st.next_pos
        n_in = 0
        if self.pending and question == self.question.strip():
            # the prefix already ends with this question and the assistant header: answer it
            driver = _Primed(self.session, self.prefix_logits)
        else:
            between = self.fmt.assistant_to_user if self.tail == "assistant" else self.fmt.user_to_user
            tokens = self.session.tokenize(between + question + self.fmt.after_user)
            n_in = len(tokens)
            if n_in + 1 > self.room():
                raise ContextFullError(self._full_message())
            try:
                self.session.prefill(tokens, seq=self.seq)
            except ContextFull:
                self._truncate(mark)
                raise ContextFullError(self._full_message()) from None
            except KeyboardInterrupt:  # nothing half-appended stays behind
                self._truncate(mark)
                raise
            driver = self.session
        self.pending = False
        self.tail = "assistant"
        limit = min(max_tokens, self.room())
        gen = generate(driver, limit, sampler, seq=self.seq, on_text=on_text)
        if gen.stopped == "length" and limit < max_tokens:
            gen.stopped = "context_full"
        self.turns.append(Turn(question, gen.text, gen.stopped, n_in, len(gen.tokens)))
        return gen

    # ------------------------------------------------------------------ reporting
    def _mode_stats(self, s: dict) -> None:
        if self.report is not None:   # compressed once: how the document was read (chunks, a policy's second pass)
            s.update(self.report.as_stats())

    def _mode_row(self, s: dict) -> str:
        return f"mode: {self.mode}, compressed once"

    def summary_line(self) -> str:
        """One line after compressing/loading: tokens, kept entries, memory saved, time, mode."""
        info = self.session.info
        s = self.stats()
        n = len(self.prefix_tokens)
        full_entries = n * info.n_layer * info.n_head_kv
        label = self.policy if self.budget is None else f"{self.policy} @ {self.budget}"
        saved = 1 - s["kv_bytes"] / s["kv_bytes_full"] if s["kv_bytes_full"] else 0.0
        line = (f"[{label}, {self.mode}] {n} tokens -> {s['kv_cells']} cells, {s['live_entries']:,} of "
                f"{full_entries:,} entries kept; {s['kv_bytes'] / 1e6:.2f} MB of {s['kv_bytes_full'] / 1e6:.2f} MB "
                f"({100 * saved:.1f}% saved)")
        if self.load_s is not None:
            line += f"; loaded in {self.load_s:.2f}s (+ model {self.model_s:.2f}s)"
        elif self.report is not None:
            line += f"; prefill {self.report.prefill_s:.2f}s, compress {self.report.compress_s:.2f}s"
            if self.report.chunk is not None:
                line += (f"; read in {len(self.report.steps)} chunks of {self.report.chunk} (at most "
                         f"{self.report.cap} cells)")
            if self.report.note:
                line += f" ({self.report.note})"
        return line

    # ------------------------------------------------------------------ .kvc files
    def to_kvc(self):
        s, st = self.session, self._st()
        meta = kvc.base_meta(s)
        meta.update({
            "policy": self.policy, "budget": self.budget, "policy_args": dict(self.policy_args),
            "resolved_params": _jsonable(getattr(self.report, "params", None)) if self.report else self.resolved_params,
            "original_tokens": len(self.prefix_tokens), "mode": self.mode, "question": self.question,
            "system": self.system, "document": self.document,
            "generic_suffix": self.generic_suffix,
            "compressed": is_compressed(s, self.seq),
            "conversation": {"reset_pos": self.reset_mark[0], "reset_cells": self.reset_mark[1],
                             "next_pos": st.next_pos, "cells": st.cells, "reindexed": st.reindexed,
                             "rope": s.rope_regime, "tail": self.tail,
                             "pending": self.pending, "turns": [t.__dict__ for t in self.turns]},
        })
        kept = st.kept_positions
        return kvc.KvcFile(meta=meta, prefix_tokens=np.asarray(self.prefix_tokens, np.int32),
                           state=cache_state(s, self.seq), kept_positions=kept,
                           prefix_logits=self.prefix_logits)

    def save(self, path, force: bool = True) -> int:
        return kvc.write(path, self.to_kvc(), force=force)

    @classmethod
    def from_kvc(cls, path, model: str | None = None, seq: int = 0, n_threads: int | None = None):
        """Load a .kvc file into a fresh session of its model (checked by hash)."""
        t0 = time.perf_counter()
        f = kvc.read(path)
        kvc.check_versions(f)
        kvc.check_meta(f)
        kvc.check_state(f)
        m = f.meta
        recorded = Path(m["model"]["path"])
        read_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        if model is None and recorded.is_file():
            model_path = resolve_model(recorded)
        else:  # --model, else KVCLI_MODEL / the config file, else the default
            model_path = resolve_model(model or config.get("model"))
        kvc.check_model(f, model_path)
        session = open_native(model_path, n_ctx=0, cache_type=m["cache_type"], flash_attn=m["flash_attn"],
                              n_threads=n_threads)
        # the mode's class: QuestionKnown where the file's prefix ends with its question
        conv = Conversation(session, m["document"], system=m.get("system"), question=m.get("question"), seq=seq,
                            prefix_tokens=[int(t) for t in f.prefix_tokens])
        # as the file records them: resolved for this model only if /policy or /budget asks for another (`_cfg`)
        conv.policy, conv.budget, conv.policy_args = m["policy"], m["budget"], dict(m.get("policy_args") or {})
        c = m["conversation"]
        if conv.prefix_tokens != session.tokenize(conv.prefix_text()):
            raise KvcliError(f"{path}: the stored prompt does not match this model's template and tokenizer")
        # sized for what the file holds + TURN_ROOM, not for the document it was compressed from
        # (recompressing with /policy or /budget reallocates for the document first)
        n_ctx = min(session.n_ctx_train, pad_cells(int(c["cells"]) + TURN_ROOM))
        if c.get("rope") == "long" and session.longrope:   # a LongRoPE cache read with the long factors keeps them
            n_ctx = max(n_ctx, session.longrope.long_ctx())
        session.create_context(n_ctx)
        conv.model_s = time.perf_counter() - t1
        t2 = time.perf_counter()
        snap = SeqSnapshot(state=f.state, next_pos=int(c["next_pos"]), cells=int(c["cells"]),
                           prompt_tokens=len(conv.prefix_tokens), kept_positions=f.kept_positions,
                           reindexed=int(c.get("reindexed", 0)), rope=c.get("rope"))
        try:
            session.restore_seq(snap, seq)  # checks the cells and the last position against the file's
        except KvcliError as e:
            raise KvcliError(f"{path}: {e}") from None
        conv.resolved_params = m.get("resolved_params")
        conv.reset_mark = (int(c["reset_pos"]), int(c["reset_cells"]))
        conv.prefix_logits = f.prefix_logits
        conv.tail, conv.pending = c["tail"], bool(c["pending"])
        if conv.pending and conv.prefix_logits is None:
            raise KvcliError(f"{path} is corrupted (an unanswered question-aware prefix without its logits)")
        conv.turns = [Turn(**t) for t in c.get("turns", [])]
        conv.load_s = read_s + time.perf_counter() - t2  # the cache itself; the model load is model_s
        return conv


class QuestionKnown(CompressedOnce, kind="aware"):
    """The document compressed once for a question known before it is read (`question`): the prefix is the whole first
    prompt, the question after the document in the same user turn, then the assistant header (as the papers do: the
    policy's observation window covers the question); the first answer is decoded from the prefix's logits."""

    generic_suffix = None

    def __post_init__(self):
        if not self.question:
            raise KvcliError("a question-aware conversation needs the question it is compressed for")
        super().__post_init__()

    @property
    def mode(self) -> str:
        return AWARE

    def prefix_text(self) -> str:
        return self.fmt.head + user_content(self.document, self.question) + self.fmt.after_user

    def _prefix_logits(self):
        return self.session.logits(self.seq)   # the first answer's first token (the prefix ends with its question)

    def _at_prefix(self) -> None:
        self.tail, self.pending, self.turns = "assistant", True, []
