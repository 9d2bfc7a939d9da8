"""Conversations over one compressed document (the `kvcli chat` REPL on top of them: kvcli/apps/chat_repl.py).

A `Conversation` owns one sequence of a NativeSession. Its cache holds:

    [ compressed prefix                 ][ turn ][ turn ] ...
      system + document (+ question)       each turn appends; nothing is recompressed

Prompt layout (see docs/terminal.md):

- question-aware (a question is known before compressing: `--question`, or the first message
  given on the command line): the prefix is the whole first prompt, the question after the
  document in the same user turn, then the assistant header, as the papers do. The policy's
  observation window therefore covers the question.
- question-agnostic (no question yet): the prefix is the user turn holding the document followed
  by GENERIC_SUFFIX, a neutral instruction that becomes the observation window (kvpress's
  question-agnostic setting: compress the context alone, ask afterwards). Each question is then
  a new user turn appended after the compressed prefix.

- re-selected (the default of `kvcli chat` with a compressing policy; kvcli/drivers/reselect.py): the document's full
  cache is read once and stored in a file; every question is answered from a cache compressed for it. The prompt
  of a question is the whole conversation, laid out as `run` lays out one question:

      [ system, user: document + first question ][ assistant: answer ][ user: question ] ... [ user: new question ]

  restored from the stored document (less its last STORE_TAIL tokens, or the policy's window), the rest (the
  document's end, the earlier
  turns, the new question) prefilled with observation, and the whole compressed to the budget by the policy,
  the new question's window scoring every entry: earlier turns are compressed with the document (they compete
  for the budget like any entry; the queries of a follow-up attend to them, so what it refers to is kept).
  The conversation's turns are kept in the stored full cache: each re-selection keeps the whole prompt's full cache
  (before compacting it) beside the stored document, in memory (StoredDocument.extension), and the next question
  restores it and prefills only what is new, the last answer (generated over the compressed cache, so not in the
  full cache) and the new question, or the policy's window when that is longer; a prompt that does not start with
  it restores from the document (exact either way: tests/test_reselect.py). /reset and --fresh drop the kept turns;
  `kvcli run`'s several questions, each asked alone, keep none (`store_turns`).

Turns are templated with the model's own chat template: the text between turns is read off
renderings of probe conversations (TurnFormat), so any template llama.cpp applies works.
`/reset` removes every cell after the prefix (`session.truncate` at the prefix's end position: llama_memory_seq_rm
in the native engine), which the native patch keeps consistent with the slot bias.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcli import config, kvc, policies
from kvcli.drivers import compress
from kvcli.planning.planner import CompressReport, resolve
from kvcli.drivers.chunked import TURN_ROOM, pad_cells, plan_chunking, read_in_float16_note, reading_cache_type
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import peak_rss_bytes
from kvcli.generate import generate
from kvcli.models import resolve_model
from kvcli.native import cache
from kvcli.native.session import ContextFull, NativeSession, SeqSnapshot
from kvcli.drivers.reselect import STORE_TAIL, StoredDocument, common_prefix
from kvcli.drivers.reselect_bounded import (ChunkedStore, check_store_target, check_usable, exact_below_bytes,
                                            read_manifest, store_types)
from kvcli.templating import GENERIC_SUFFIX

AWARE, AGNOSTIC, RESELECTED = "question-aware", "question-agnostic", "re-selected"
# the memory figures every --json output carries (run, chat, compress): docs/internals.md, "Memory figures"
MEMORY_STATS = ("kv_bytes_allocated", "kv_cells_allocated", "kv_bytes_live", "peak_rss_bytes")


class ContextFullError(KvcliError):
    """The conversation does not fit the context any more; /reset makes room."""


# ---------------------------------------------------------------------------------- templates
_MA, _MB, _MC = "KVCLIPROBEAAAA", "KVCLIPROBEBBBB", "KVCLIPROBECCCC"


@dataclass
class TurnFormat:
    """The chat template cut at message boundaries."""

    head: str                 # everything before the first user message's content (system turn, BOS...)
    after_user: str           # end of a user message + start of the assistant's
    assistant_to_user: str    # end of an assistant message + start of the next user message
    user_to_user: str         # end of a user message + start of another user message

    @classmethod
    def probe(cls, session, system: str | None) -> "TurnFormat":
        sys_msg = [{"role": "system", "content": system}] if system else []

        def render(*msgs):
            roles = ["user", "assistant", "user"] if len(msgs) == 3 else ["user", "user"]
            return session.apply_chat_template(sys_msg + [{"role": r, "content": c} for r, c in zip(roles, msgs)],
                                               add_assistant=True)

        try:
            abc = render(_MA, _MB, _MC)
            ac = render(_MA, _MC)
        except Exception as e:  # a jinja template may refuse two user turns in a row
            raise KvcliError(f"the model's chat template cannot hold a multi-turn conversation ({e})") from None
        try:
            ia, ib, ic = abc.index(_MA), abc.index(_MB), abc.index(_MC)
            ja, jc = ac.index(_MA), ac.index(_MC)
        except ValueError:
            raise KvcliError("the model's chat template drops message contents: cannot lay out turns") from None
        fmt = cls(head=abc[:ia], after_user=abc[ic + len(_MC):],
                  assistant_to_user=abc[ib + len(_MB):ic], user_to_user=ac[ja + len(_MA):jc])
        if ac[:ja] != fmt.head or abc[ia + len(_MA):ib] != fmt.after_user:
            raise KvcliError("the model's chat template renders turns inconsistently: cannot lay out turns")
        return fmt


def user_content(document: str, tail: str) -> str:
    return f"{document.strip()}\n\n{tail.strip()}"


def _jsonable(params: dict | None) -> dict | None:
    return None if params is None else {k: list(v) if isinstance(v, tuple) else v for k, v in params.items()}


# ---------------------------------------------------------------------------------- conversation
@dataclass
class Turn:
    question: str
    answer: str
    stopped: str
    tokens_in: int
    tokens_out: int


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


@dataclass
class Conversation:
    session: object
    document: str
    policy: str = "full"
    budget: int | None = None
    policy_args: dict = field(default_factory=dict)
    system: str | None = None
    question: str | None = None          # set: question-aware compression
    seq: int = 0
    chunk: int | None = None             # chunked prefill (kvcli/drivers/chunked.py): None = automatic, 0 = off
    max_cache: int | None = None         # most cells the cache may hold (document + conversation)
    chunk_scoring: str = "question"      # chunked: which queries score each chunk (kvcli/drivers/chunked.py)
    # filled by compress() / from_kvc()
    fmt: TurnFormat | None = None
    prefix_tokens: list[int] = field(default_factory=list)
    reset_mark: tuple[int, int] = (0, 0)  # (next position, cells) right after the compressed prefix
    prefix_logits: np.ndarray | None = None
    tail: str = "user"                    # the cache ends inside a "user" or an "assistant" message
    pending: bool = False                 # question-aware prefix whose question is not answered yet
    turns: list[Turn] = field(default_factory=list)
    report: object = None                 # CompressReport of the last compression
    resolved_params: dict | None = None   # the policy parameters as resolved when a loaded file was compressed
    load_s: float | None = None          # reading + checking + restoring a .kvc file (not the model)
    model_s: float | None = None          # loading the model and allocating the context, for a .kvc file
    reselect: bool = False                # re-select the cache for every question from the stored full cache
    store_path: Path | None = None        # re-selected: where the document's full cache is stored (kept at close)
    store: StoredDocument | None = None
    last_reselection: object = None       # re-selected: the Reselection of the last question
    notify: object = None                 # re-selected: called with a line to tell the user (the store re-read)
    prompt_len: int = 0                   # re-selected: tokens of the last question's whole prompt
    store_turns: bool = True              # re-selected: keep the conversation's turns in the stored full cache
    cache_type: str | None = None         # the K/V type asked for (default: the session's); a bounded store's chunk
                                          # files hold it, read in float16 (reselect_bounded.store_types)

    def __post_init__(self):
        if self.policy == "full":   # re-selected with `full` (kvcli run's several questions): the whole stored
            self.budget = None      # document restored for every question, no plan
        if self.reselect and self.question:
            raise KvcliError("re-selection compresses for every question as it comes: a question given before the "
                             "document is read is only its first one (ask it, or use --compress-once)")
        self.cache_type = self.cache_type or self.session.cache_type
        self.fmt = self.fmt or TurnFormat.probe(self.session, self.system)
        if not self.prefix_tokens:
            self.prefix_tokens = self.session.tokenize(self.prefix_text())

    @property
    def mode(self) -> str:
        if self.reselect:
            return RESELECTED
        return AWARE if self.question else AGNOSTIC

    def prefix_text(self) -> str:
        if self.reselect:   # the part every question's prompt starts with
            return self.fmt.head + self.document.strip()
        if self.question:
            return self.fmt.head + user_content(self.document, self.question) + self.fmt.after_user
        return self.fmt.head + user_content(self.document, GENERIC_SUFFIX)

    # ------------------------------------------------------------------ cache bookkeeping
    def _st(self):
        return self.session.seq(self.seq)

    def _measured_cells(self) -> int:
        info = self.session.info
        return cache.stats(self.session.ctx, self.seq, info.n_layer_model, info.n_head_kv)["n_cells"]

    def _truncate(self, pos: int) -> None:
        """Remove every cell at position >= pos from the sequence."""
        self.session.truncate(self.seq, pos)

    def chunking(self):
        """Chunked or not, and the cells to allocate: the prompt (or, read in chunks, budget + chunk) plus TURN_ROOM
        for the conversation (less when --max-cache leaves less)."""
        return plan_chunking(len(self.prefix_tokens), TURN_ROOM, self.session.n_ctx_train, self.policy, self.budget,
                             self.chunk, self.max_cache, cell_bytes=self.session.info.cell_bytes(self.cache_type))

    def ensure_context(self) -> None:
        if self.session.ctx is None:
            self.session.create_context(self.chunking().n_ctx)

    # ------------------------------------------------------------------ re-selection
    def read_store(self, progress=None, colsum: bool | None = None):
        """Re-selected: read the document once and store it: its full cache (exact re-selection,
        kvcli/drivers/reselect.py), in a context that holds the whole document and TURN_ROOM for the conversation,
        with the column sums the policy scores by (`colsum` True/False: with or without them, whatever the policy:
        kvcli compress --store); or, where bounded reading would read it in chunks (`store_form`), chunk by chunk
        as bounded reading reads it (kvcli/drivers/reselect_bounded.py): the cache never holds more than the budget
        and a chunk."""
        n = len(self.prefix_tokens)
        limit = self.session.n_ctx_train
        cfg = self._cfg(None)
        form, chunking = self.store_form(cfg)
        if self.store is not None:
            self.store.close()
        named = self.store_path is not None
        if named:   # a folder for the bounded form, a .kvc file for the exact one: checked before the read
            check_store_target(self.store_path, form=form)
        if form == "bounded":
            working, chunk_type = store_types(self.cache_type)
            self.session.clear()
            self.session.use_cache_type(working)   # frees the context when the type changes
            n_seq = max(2, self.seq + 2)    # and one to load the stored chunks through, per question
            if self.session.ctx is None:
                self.session.create_context(chunking.n_ctx, n_seq)
            else:
                self.session.resize_context(chunking.n_ctx, n_seq)
            self.store = ChunkedStore.read(self.session, self.prefix_tokens, cfg, chunking.chunk, cap=chunking.cap,
                                           seq=self.seq, spare=self.seq + 1, path=self.store_path, keep=named,
                                           chunk_type=chunk_type,
                                           progress=progress, notify=self._say,
                                           meta={"document": self.document, "system": self.system})
            self.report = CompressReport(self.policy, self.budget, n, self.store.read_s, params=cfg.params,
                                         chunk=chunking.chunk, cap=chunking.cap)
            self.turns, self.last_reselection, self.prompt_len = [], None, 0
            return self.report
        want = min(limit, pad_cells(n + TURN_ROOM))
        if self.max_cache is not None:
            want = min(want, self.max_cache)
        if self.session.cache_type != self.cache_type:   # a bounded store was read before in float16
            self.session.clear()
            self.session.use_cache_type(self.cache_type)
        if self.session.ctx is None:
            self.session.create_context(want)
        elif self.session.n_ctx < want:
            self.session.clear(self.seq)
            self.session.resize_context(want)
        self.store = StoredDocument.read(self.session, self.prefix_tokens, seq=self.seq,
                                         colsum="colsum" in cfg.observe[0] if colsum is None else colsum,
                                         path=self.store_path, keep=named,
                                         progress=progress, meta={"document": self.document, "system": self.system},
                                         # --store FILE: must be written
                                         in_memory_if_unwritable=None if named else self._say)
        self.report = CompressReport(self.policy, self.budget, n, self.store.read_s, params=cfg.params)
        self.turns, self.last_reselection, self.prompt_len = [], None, 0
        return self.report

    def store_form(self, cfg):
        """("exact", None) or ("bounded", the Chunking of its read). Bounded where bounded reading would read the
        document in chunks and its full cache is above reselect_bounded.exact_below_bytes() (256 MiB), where it is
        longer than the context or --max-cache, or with --chunk N; exact elsewhere, and where bounded re-selection
        cannot serve (a column-sum policy, a model with sliding-window layers, the reference engine) and the
        document's full cache fits the context."""
        n = len(self.prefix_tokens)
        limit = self.session.n_ctx_train
        fits = n + STORE_TAIL + 64 <= limit and (self.max_cache is None or n + STORE_TAIL + 64 <= self.max_cache)
        chunking = self.chunking()
        why = ""
        small = n * self.session.info.cell_bytes(self.cache_type) <= exact_below_bytes()
        if chunking.chunk is not None and not (self.chunk is None and self.max_cache is None and fits and small):
            try:
                check_usable(self.session, cfg)
                return "bounded", chunking
            except KvcliError as e:
                why = str(e)
        if n + STORE_TAIL + 64 > limit:
            raise KvcliError(f"the document is {n} tokens, longer than the model's context ({limit} tokens): "
                             + (f"bounded re-selection cannot serve it ({why}); " if why else "")
                             + "use --compress-once")
        if self.chunk:
            raise KvcliError(f"--chunk {self.chunk}: bounded re-selection cannot serve this ({why}); drop --chunk "
                             "or use --compress-once")
        if not fits:
            raise KvcliError(f"exact re-selection holds the document's full cache ({n} cells), more than --max-cache "
                             f"{self.max_cache}, and bounded re-selection cannot serve this ({why}): use "
                             "--compress-once")
        return "exact", None

    def _streamed(self, st) -> str:
        """Which stored chunks a question streams, in words (the summary line)."""
        select = st.chunks_per_question(self.budget)
        if select is None or len(st.chunks) <= select + 2:
            return "them all"
        return f"the first, the last and the {select} its block index scores best (page bounds, then real keys)"

    def _say(self, line: str) -> None:
        if self.notify:
            self.notify(f"[{line}]")
        else:
            print(f"kvcli: {line}", file=sys.stderr, flush=True)

    def _cfg(self, question: str | None):
        """The policy resolved for the model (windowkv's task=auto classifies the question)."""
        return resolve(self.session.model_path, self.policy, self.budget, dict(self.policy_args), question)

    def conversation_text(self, question: str) -> str:
        """The whole prompt of a question: the document and the first question in one user turn (as `run` lays out
        one question), then every earlier answer and question, then the new one."""
        turns = [t for t in self.turns if t.answer or t.stopped != "interrupted"]
        qs = [t.question for t in turns] + [question]
        text = self.fmt.head + user_content(self.document, qs[0]) + self.fmt.after_user
        for t, q in zip(turns, qs[1:]):
            text += t.answer + self.fmt.assistant_to_user + q + self.fmt.after_user
        return text

    def _ask_reselected(self, question: str, max_tokens: int, sampler, on_text):
        prompt = self.session.tokenize(self.conversation_text(question))
        before = self.prompt_len + (self.turns[-1].tokens_out if self.turns else 0)
        # exact: the whole prompt is held before its compaction; bounded: the kept entries, a chunk and the rest
        held = len(prompt) - self.store.split + self.store.cap if self.store.bounded else len(prompt)
        if held + 1 + min(max_tokens, 64) > min(self.session.n_ctx, self.session.n_ctx_train):
            raise ContextFullError(f"the conversation ({len(prompt)} tokens with the document) does not fit the "
                                   f"context ({self.session.n_ctx} cells): /reset goes back to the document alone")
        cfg = self._cfg(question)
        if self.store.path is not None and not self.store.path.exists():  # deleted while chatting
            self._say(f"the stored cache {self.store.path} is gone: reading the document again")
            self.store.keep = False
            self.read_store_keeping_turns()
        self._store_colsum_for(cfg)
        try:
            self.last_reselection = self.store.reselect(self.session, prompt, cfg, seq=self.seq,
                                                        extend=self.store_turns)
        except BaseException:   # Ctrl-C or a failure: nothing half done stays; the turns are as they were
            self.session.clear(self.seq)
            raise
        limit = min(max_tokens, self.room())
        gen = generate(self.session, limit, sampler, seq=self.seq, on_text=on_text)
        if gen.stopped == "length" and limit < max_tokens:
            gen.stopped = "context_full"
        self.turns.append(Turn(question, gen.text, gen.stopped, max(0, len(prompt) - before), len(gen.tokens)))
        self.prompt_len = len(prompt)
        return gen

    def _store_colsum_for(self, cfg) -> None:
        """A column-sum policy on a store read without the sums: read the document once more, with them (said)."""
        if "colsum" in cfg.observe[0] and self.store.colsum is None:
            if self.store.bounded:
                raise KvcliError(f"policy {self.policy} scores by column sums, which bounded re-selection does not "
                                 "replay: choose a window policy (snapkv, pyramidkv, ...)")
            self._say(f"policy {self.policy} scores by column sums: reading the document again to store them")
            self.read_store_keeping_turns()

    def read_store_keeping_turns(self) -> None:
        turns = self.turns
        self.read_store()
        self.turns = turns

    # ------------------------------------------------------------------ compression
    def compress(self, progress=None, on_cache=None):
        """Prefill the prefix and compress it (kvcli.drivers.compress.prefill_and_compress), in chunks when it is longer
        than the context allows; re-selected: read the document and store its full cache (`read_store`)."""
        if self.reselect:
            return self.read_store(progress)
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
        # the question (aware) is the instruction task-adaptive policies classify; agnostic has none
        self.report = compress.prefill_and_compress(self.session, self.prefix_tokens, self.policy, self.budget,
                                                    dict(self.policy_args), seq=self.seq, progress=progress,
                                                    instruction=self.question, chunk=chunking.chunk,
                                                    cap=chunking.cap, on_cache=on_cache, scoring=self.chunk_scoring)
        if held != self.cache_type:
            self.report.note = "; ".join(filter(None, (self.report.note, read_in_float16_note(self.cache_type))))
        st = self._st()
        st.cells = self._measured_cells()
        self.reset_mark = (st.next_pos, st.cells)
        self.prefix_logits = self.session.logits(self.seq) if self.question else None
        if self.report.plan is not None:
            cache.set_header(self.session.ctx, self.seq, self.policy, int(self.budget), len(self.prefix_tokens))
            self.fit_context()
        self._at_prefix()
        return self.report

    def fit_context(self) -> None:
        """Give back the cells the document needed and the compressed prefix does not: the context is
        reallocated for what the session holds + TURN_ROOM (NativeSession.resize_context), so a long-lived
        conversation does not keep a KV buffer sized for the whole document."""
        s = self.session
        want = min(pad_cells(s.cells_used() + TURN_ROOM), s.n_ctx_train)
        if want < s.n_ctx:
            s.resize_context(want)

    def _at_prefix(self) -> None:
        self.tail = "assistant" if self.question else "user"
        self.pending = bool(self.question)
        self.turns = []

    def recompress(self, policy: str | None = None, budget: int | None = None, policy_args: dict | None = None,
                   progress=None):
        """Compress the original document again with another policy or budget (the conversation is
        dropped). If that fails or is interrupted, the cache as it was is put back."""
        new_policy = (policy or self.policy).lower()
        if new_policy == "full":
            if budget is not None and policy is None:
                raise KvcliError("policy full keeps every entry: choose a policy with /policy NAME N")
            new_budget, new_args = None, {}
        else:
            policies.get(new_policy)
            new_budget = budget if budget is not None else self.budget
            if new_budget is None:
                raise KvcliError(f"policy '{new_policy}' needs a budget: /policy {new_policy} N")
            new_args = policy_args if policy_args is not None else (
                self.policy_args if new_policy == self.policy else {})
            policies.prepare(new_policy, new_args, new_budget, instruction=self.question)
        if self.reselect:   # nothing to read again: the next question is re-selected with the new choice
            if new_policy == "full":
                raise KvcliError("re-selection needs a compressing policy: /policy NAME N")
            fields = dict(self.__dict__)
            self.policy, self.budget, self.policy_args = new_policy, new_budget, dict(new_args)
            try:
                self._store_colsum_for(self._cfg(None))
            except BaseException:
                self.__dict__.update(fields)
                raise
            return self.report
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
        if self.reselect:   # the next question starts again from the stored document: the kept turns go
            self.turns, self.last_reselection, self.prompt_len = [], None, 0
            if self.store is not None:
                self.store.extension = None
            return
        pos, cells = self.reset_mark
        self._truncate(pos)
        if self._st().cells != cells:
            raise KvcliError(f"/reset left {self._st().cells} cells, expected the {cells} of the compressed document")
        self._at_prefix()

    # ------------------------------------------------------------------ turns
    def room(self) -> int:
        """Tokens that can still be appended: free cells, and positions left in the model's context."""
        s = self.session
        return min(s.n_ctx - s.cells_used(), s.n_ctx_train - self._st().next_pos)

    def _full_message(self) -> str:
        st = self._st()
        return (f"the context is full ({st.cells} of {self.session.n_ctx} cells, position {st.next_pos} of "
                f"{self.session.n_ctx_train}): /reset goes back to the compressed document")

    def ask(self, question: str, max_tokens: int, sampler=None, on_text=None):
        """Append one user turn and generate the answer; returns the Generation."""
        question = question.strip()
        if not question:
            raise KvcliError("the question is empty")
        if self.reselect:
            return self._ask_reselected(question, max_tokens, sampler, on_text)
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
    def stats(self) -> dict:
        info = self.session.info
        s = self.session.stats(self.seq)
        live = cache.stats(self.session.ctx, self.seq, info.n_layer_model, info.n_head_kv)
        s.update(live_entries=live["live_entries"],
                 k_bytes=live["k_bytes"], v_bytes=live["v_bytes"], bias_bytes=live["bias_bytes"],
                 next_pos=self._st().next_pos, n_ctx=self.session.n_ctx, peak_rss_bytes=peak_rss_bytes())
        s["mode"] = self.mode
        if self.reselect and self.store is not None:
            ext = self.store.extension
            s.update(store_bytes=self.store.nbytes, store_path=str(self.store.path) if self.store.path else None,
                     reselect_form="bounded" if self.store.bounded else "exact",
                     document_read_s=round(self.store.read_s, 4),
                     stored_turn_tokens=0 if ext is None else ext.split - self.store.split,
                     stored_turns_bytes=0 if ext is None else ext.nbytes)
            if self.last_reselection is not None:
                s.update(self.last_reselection.as_stats())
        elif self.report is not None:   # compressed once: how the document was read (chunks, kvzip's pass)
            s.update(self.report.as_stats())
        return s

    def summary_line(self) -> str:
        """One line after compressing/loading: tokens, kept entries, memory saved, time, mode."""
        info = self.session.info
        s = self.stats()
        n = len(self.prefix_tokens)
        full_entries = n * info.n_layer * info.n_head_kv
        label = self.policy if self.budget is None else f"{self.policy} @ {self.budget}"
        if self.reselect:
            st = self.store
            where = f" in {st.path}" + ("" if st.keep else " (deleted at exit)") if st.path else " in memory"
            line = (f"[{label}, re-selected per question] {n} tokens read in {st.read_s:.2f}s; full cache stored "
                    f"({st.nbytes / 1e6:.2f} MB{where}); each question is answered from {self.budget} entries per "
                    "layer and KV head chosen for it")
            if st.bounded:
                line = (f"[{label}, re-selected per question, bounded] {n} tokens read in chunks of {st.chunk} in "
                        f"{st.read_s:.2f}s and stored as read ({len(st.chunks)} chunks, "
                        f"{st.nbytes / 1e6:.2f} MB{where});"
                        f" each question streams {self._streamed(st)} through the context's {self.session.n_ctx} "
                        f"cells and is answered from {self.budget} entries per layer and KV head chosen for it")
            if self.load_s is not None:
                form = f", bounded] {n} tokens stored in {len(st.chunks)} chunks" if st.bounded else \
                    f"] {n} tokens stored"
                line = (f"[{label}, re-selected per question{form} in {st.path} ({st.nbytes / 1e6:.2f} "
                        f"MB; {len(self.turns)} turn(s)); loaded in {self.load_s:.2f}s (+ model {self.model_s:.2f}s)")
            return line
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

    def stats_table(self) -> str:
        info = self.session.info
        s = self.stats()
        per_layer_bytes = (s["k_bytes"] + s["v_bytes"] + s["bias_bytes"]) / max(1, info.n_layer)
        rows = [f"sequence: {s['kv_cells']} cells held, next position {s['next_pos']}, context "
                f"{self.session.cells_used()}/{s['n_ctx']} cells; {s['kv_bytes'] / 1e6:.2f} MB of "
                f"{s['kv_bytes_full'] / 1e6:.2f} MB uncompressed; {len(self.turns)} turn(s) since the document",
                f"memory: KV buffer allocated {s['kv_bytes_allocated'] / 1e6:.2f} MB "
                f"({s['kv_cells_allocated']} cells); "
                f"live entries {s['kv_bytes_live'] / 1e6:.2f} MB; process peak RSS "
                + ("not measured" if s["peak_rss_bytes"] is None else f"{s['peak_rss_bytes'] / 1e6:.0f} MB"),
                f"{'layer':>5} {'live cells':>10} {'entries per KV head':>22} {'bytes':>10}"]
        if self.reselect:
            r = self.last_reselection
            rows.insert(0, "mode: re-selected per question"
                           + (f" (bounded: {len(self.store.chunks)} stored chunks streamed)"
                              if self.store.bounded else "")
                           + f"; document read once in {self.store.read_s:.2f}s, "
                           f"cache stored: {self.store.nbytes / 1e6:.2f} MB "
                           f"({self.store.path or 'in memory'}); last re-selection: "
                           + ("none yet" if r is None else
                              f"{r.total_s:.2f}s (restore {r.restore_s:.2f}s of {r.restored} entries from the "
                              f"{'conversation' if r.source == 'conversation' else 'stored document'}, prefill "
                              f"{r.prefill_s:.2f}s of {r.prefilled} tokens, plan and compaction {r.plan_s:.2f}s"
                              + (f", turns kept {r.keep_s:.2f}s" if r.keep_s else "") + ")")
                           + ("" if self.store.extension is None else
                              f"; the conversation's full cache kept in memory: {s['stored_turn_tokens']} tokens "
                              f"after the document ({s['stored_turns_bytes'] / 1e6:.2f} MB "
                              + (f"in {len(self.store.extension.chunks)} turn chunks)" if self.store.bounded
                                 else "with it)")))
        else:
            rows.insert(0, f"mode: {self.mode}, compressed once")
        for il in range(len(s["per_layer_cells"])):
            heads = " ".join(str(x) for x in s["per_head_entries"][il])
            if il in info.sliding_layers:  # llama.cpp's window cache, not compressed
                rows.append(f"{il:>5} {s['per_layer_cells'][il]:>10} {heads:>22} {'sliding':>10}")
            else:
                rows.append(f"{il:>5} {s['per_layer_cells'][il]:>10} {heads:>22} {per_layer_bytes:>10,.0f}")
        return "\n".join(rows)

    # ------------------------------------------------------------------ .kvc files
    def to_kvc(self):
        s, st = self.session, self._st()
        meta = kvc.base_meta(s)
        meta.update({
            "policy": self.policy, "budget": self.budget, "policy_args": dict(self.policy_args),
            "resolved_params": _jsonable(getattr(self.report, "params", None)) if self.report else self.resolved_params,
            "original_tokens": len(self.prefix_tokens), "mode": self.mode, "question": self.question,
            "system": self.system, "document": self.document,
            "generic_suffix": None if self.question else GENERIC_SUFFIX,
            "compressed": bool(cache.is_compressed(s.ctx, self.seq)),
            "conversation": {"reset_pos": self.reset_mark[0], "reset_cells": self.reset_mark[1],
                             "next_pos": st.next_pos, "cells": st.cells, "reindexed": st.reindexed,
                             "rope": s.rope_regime, "tail": self.tail,
                             "pending": self.pending, "turns": [t.__dict__ for t in self.turns]},
        })
        kept = st.kept_positions
        return kvc.KvcFile(meta=meta, prefix_tokens=np.asarray(self.prefix_tokens, np.int32),
                           state=cache.get_state(s.ctx, self.seq), kept_positions=kept,
                           prefix_logits=self.prefix_logits)

    def save(self, path, force: bool = True) -> int:
        if self.reselect:   # the document's full cache and the turns: `kvcli chat --cache FILE` re-selects from it
            return self.store.save_as(path, self.session, [t.__dict__ for t in self.turns])
        return kvc.write(path, self.to_kvc(), force=force)

    def close(self) -> None:
        """Delete the stored document's cache unless it is kept."""
        if self.store is not None:
            self.store.close()

    @classmethod
    def from_store(cls, path, *, policy: str, budget: int, policy_args: dict | None = None, model: str | None = None,
                   seq: int = 0, n_threads: int | None = None, cache_type: str | None = None):
        """A re-selected conversation over a stored full document cache (kvcli compress --store, /save of a
        re-selected chat, or any uncompressed .kvc file), or a bounded store folder (`from_chunked_store`): the
        document is not read again."""
        if Path(path).expanduser().is_dir():
            return cls.from_chunked_store(path, policy=policy, budget=budget, policy_args=policy_args, model=model,
                                          seq=seq, n_threads=n_threads, cache_type=cache_type)
        t0 = time.perf_counter()
        f = kvc.read(path)
        kvc.check_versions(f)
        kvc.check_meta(f)
        m = f.meta
        if m["compressed"]:
            raise KvcliError(f"{path} holds a compressed cache ({m['policy']} @ {m['budget']}): --policy/--budget "
                             "re-select from a document's full cache (kvcli compress --store); drop them to use it")
        recorded = Path(m["model"]["path"])
        model_path = resolve_model(recorded) if model is None and recorded.is_file() else \
            resolve_model(model or config.get("model"))
        kvc.check_model(f, model_path)
        if cache_type is not None and cache_type != m["cache_type"]:
            raise KvcliError(f"{path} holds a {m['cache_type']} cache: drop --cache-type")
        kvc.check_state(f)   # with the checks above, kvc.load_checked's: the file is read and checked once
        t1 = time.perf_counter()
        session = NativeSession(model_path, n_ctx=0, cache_type=m["cache_type"], flash_attn=m["flash_attn"],
                                n_threads=n_threads)
        store = StoredDocument.from_kvc(f)
        del f
        conv = cls(session, store.meta["document"], policy=policy, budget=budget, policy_args=dict(policy_args or {}),
                   system=store.meta.get("system"), seq=seq, reselect=True)
        # a file of `compress --store` holds the document's tokens; one of `compress --policy full` holds the
        # generic instruction after them too, whose entries are cut off at every question (StoredDocument.restore)
        if common_prefix(conv.prefix_tokens, store.tokens) < min(len(conv.prefix_tokens), store.split) - STORE_TAIL:
            raise KvcliError(f"{path}: the stored prompt does not match this model's template and tokenizer")
        conv.store = store
        cfg = conv._cfg(None)   # the policy checked now, not at the first question
        if "colsum" in cfg.observe[0] and store.colsum is None:
            raise KvcliError(f"{path} holds no column sums, which policy '{policy}' scores by: store it with "
                             "kvcli compress --store --policy " + policy)
        n = len(conv.prefix_tokens)
        session.create_context(min(session.n_ctx_train, pad_cells(n + TURN_ROOM)))
        conv.model_s = time.perf_counter() - t1
        conv.turns = [Turn(**t) for t in store.meta.get("turns", [])]
        conv.report = CompressReport(policy, budget, n, 0.0, params=cfg.params)
        conv.load_s = t1 - t0
        return conv

    @classmethod
    def from_chunked_store(cls, path, *, policy: str, budget: int | None, policy_args: dict | None = None,
                           model: str | None = None, seq: int = 0, n_threads: int | None = None,
                           cache_type: str | None = None):
        """A re-selected conversation over a bounded store folder (kvcli chat --store DIR, kvcli compress --store
        -o DIR, /save DIR of a bounded chat): its chunks are streamed for every question as in the chat that read
        the document (kvcli/drivers/reselect_bounded.py); the document is not read again. Refused in one line when
        the folder is not a whole store of this model (ChunkedStore.open) or the policy cannot be re-selected in
        bounded chunks (a column-sum policy, no budget)."""
        t0 = time.perf_counter()
        path = Path(path).expanduser()
        m = read_manifest(path)
        if policy == "full" or budget is None:
            raise KvcliError(f"{path} is a bounded store (the document in chunks, re-selected per question): give a "
                             "compressing --policy P and --budget N")
        recorded = Path(m["model"]["path"])
        model_path = resolve_model(recorded) if model is None and recorded.is_file() else \
            resolve_model(model or config.get("model"))
        stored_type = m.get("chunk_type", m["cache_type"])   # q8_0 chunk files are read in a float16 cache
        if cache_type is not None and cache_type != stored_type:
            raise KvcliError(f"{path} holds a {stored_type} cache: drop --cache-type")
        store = ChunkedStore.open(path, model_path, manifest=m)   # the model's hash, then every chunk file
        t1 = time.perf_counter()
        session = NativeSession(model_path, n_ctx=0, cache_type=m["cache_type"], flash_attn=m["flash_attn"],
                                n_threads=n_threads)
        try:
            conv = cls(session, store.meta["document"], policy=policy, budget=budget,
                       policy_args=dict(policy_args or {}), system=store.meta.get("system"), seq=seq, reselect=True,
                       cache_type=stored_type)
            if common_prefix(conv.prefix_tokens, store.tokens) < store.split:
                raise KvcliError(f"{path}: the stored prompt does not match this model's template and tokenizer")
            cfg = conv._cfg(None)   # the policy checked now, not at the first question
            check_usable(session, cfg)
            store.cap = budget + store.chunk
            conv.store = store
            # as the chat that read it: the kept entries, a chunk, and TURN_ROOM; one more sequence to load through
            session.create_context(min(session.n_ctx_train, pad_cells(store.cap + TURN_ROOM)),
                                   max(2, seq + 2))
        except BaseException:
            session.close()
            raise
        conv.model_s = time.perf_counter() - t1
        conv.turns = [Turn(**t) for t in store.meta.get("turns", [])]
        conv.report = CompressReport(policy, budget, len(conv.prefix_tokens), 0.0, params=cfg.params,
                                     chunk=store.chunk, cap=store.cap)
        conv.load_s = t1 - t0
        return conv

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
        session = NativeSession(model_path, n_ctx=0, cache_type=m["cache_type"], flash_attn=m["flash_attn"],
                                n_threads=n_threads)
        conv = cls(session, m["document"], policy=m["policy"], budget=m["budget"],
                   policy_args=dict(m.get("policy_args") or {}), system=m.get("system"), question=m.get("question"),
                   seq=seq, prefix_tokens=[int(t) for t in f.prefix_tokens])
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
