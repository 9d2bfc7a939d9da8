"""Re-selected conversations (kvcli/apps/chat.py: the modes): the document's cache is read once and stored, and every
question is answered from a cache compressed for it (kvcli/drivers/reselect.py). Each form of the store is a class:

- exact (`ReselectedExact`, here): the document's whole full cache stored (and held resident in the context where the
  engine can share its cells), each question re-selected from it;
- bounded (`ReselectedBounded`, kvcli/apps/chat_bounded.py): the document stored chunk by chunk as bounded reading
  reads it (kvcli/drivers/reselect_bounded.py), the cache never holding more than the budget and a chunk; its chunks
  streamed for every question.

`Reselected` is what both share (the prompt's layout, the turns, /policy, /budget, /reset, /stats, /save, the summary
line). `Conversation(..., reselect=True)` builds one; reading the document (`read_store`) picks the form
(`store_form`) and makes the conversation that form's class. A read again (the stored cache deleted while chatting, a
column-sum policy on a store without the sums) picks the form again for the policy and budget then chosen, so the
class follows it. `from_store` opens a stored document in the form it was stored in: a .kvc file exact, a store
folder bounded.
"""
from __future__ import annotations

import time
from pathlib import Path

from kvcli import config, doc_formats, kvc
from kvcli.apps.chat_base import RESELECTED, ContextFullError, Conversation, Turn, user_content
from kvcli.drivers.chunked import TURN_ROOM, pad_cells
from kvcli.drivers.reselect import STORE_TAIL, StoredDocument, common_prefix
from kvcli.drivers.reselect_bounded import check_store_target, check_usable, exact_below_bytes, read_manifest
from kvcli.errors import KvcliError
from kvcli.generate import generate
from kvcli.models import resolve_model
from kvcli.engines import open_native, shares_cells
from kvcli.planning.planner import CompressReport

# The exact form holds the document resident in the context (kvcli/drivers/resident.py): its full cache in
# RESIDENT_SEQ, each question prefilled in one of QUESTION_SEQS after the shared document cells (the last one kept as
# the conversation's turns, which the next question shares in turn), its selection gathered into the answer's
# sequence (Conversation.seq, 0). Sequences 2-4 are the resident path's (1 stays free: a spare for loading through);
# the answer's must be another.
RESIDENT_SEQ = 2
QUESTION_SEQS = (3, 4)


class Reselected(Conversation, kind="reselected"):
    """Re-selected per question from the document's stored cache: what the exact and bounded forms share. Built by
    Conversation(reselect=True) before the document is read; `read_store` makes it its form's class.

    `window_from`: what scores a window policy's selection in the exact form, its whole window as `kvcli run`'s
    does (the first answer is run's, tested), or "question" (its own tokens: kvcli serve's default, --window-from)."""

    window_from = "policy"

    def __post_init__(self):
        if self.question:
            raise KvcliError("re-selection compresses for every question as it comes: a question given before the "
                             "document is read is only its first one (ask it, or use --compress-once)")
        self.reselect = True
        super().__post_init__()

    @property
    def mode(self) -> str:
        return RESELECTED

    def prefix_text(self) -> str:
        return self.fmt.head + self.document.strip()   # the part every question's prompt starts with

    # ------------------------------------------------------------------ reading the document
    def compress(self, progress=None, on_cache=None):
        """Read the document and store its cache (`read_store`)."""
        return self.read_store(progress)

    def read_store(self, progress=None, colsum: bool | None = None):
        """Read the document once and store it in the form `store_form` picks, this conversation becoming that form's
        class: its full cache (ReselectedExact; `colsum` True/False: with or without the column sums, whatever the
        policy: kvcli compress --store), or chunk by chunk as bounded reading reads it (ReselectedBounded)."""
        cfg = self._cfg(None)
        form, chunking = self.store_form(cfg)
        if self.store is not None:
            self.store.close()
        named = self.store_path is not None
        if named:   # a folder for the bounded form, a .kvc file for the exact one: checked before the read
            check_store_target(self.store_path, form=form)
        # the form is the store's, picked at each read (a read again may pick the other one): the class follows it
        self.__class__ = Conversation.kinds[form]
        self.report = self._read_document(cfg, chunking, progress, colsum, named)
        self.turns, self.last_reselection, self.prompt_len = [], None, 0
        return self.report

    def _read_document(self, cfg, chunking, progress, colsum: bool | None, named: bool):
        """Read the document into the form's store (self.store); returns the CompressReport of the read."""
        raise NotImplementedError

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

    # ------------------------------------------------------------------ questions
    def conversation_text(self, question: str) -> str:
        """The whole prompt of a question: the document and the first question in one user turn (as `run` lays out
        one question), then every earlier answer and question, then the new one."""
        turns = [t for t in self.turns if t.answer or t.stopped != "interrupted"]
        qs = [t.question for t in turns] + [question]
        text = self.fmt.head + user_content(self.document, qs[0]) + self.fmt.after_user
        for t, q in zip(turns, qs[1:]):
            text += t.answer + self.fmt.assistant_to_user + q + self.fmt.after_user
        return text

    def ask(self, question: str, max_tokens: int, sampler=None, on_text=None):
        """Re-select the cache for the whole conversation with this question and generate the answer; returns the
        Generation."""
        question = question.strip()
        if not question:
            raise KvcliError("the question is empty")
        prompt = self.session.tokenize(self.conversation_text(question))
        before = self.prompt_len + (self.turns[-1].tokens_out if self.turns else 0)
        held = self._held_cells(len(prompt))
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
            self.last_reselection = self._reselect(prompt, cfg)
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

    def _held_cells(self, n_prompt: int) -> int:
        """The most cells the context holds while a prompt of n_prompt tokens is re-selected."""
        raise NotImplementedError

    def _reselect(self, prompt: list[int], cfg):
        """The prompt re-selected from the store into the answer's sequence (self.seq); returns the Reselection."""
        raise NotImplementedError

    def _store_colsum_for(self, cfg) -> None:
        """A column-sum policy on a store read without the sums: read the document once more, with them (said). A
        bounded store is read in chunks once: what bounded re-selection cannot serve (column sums or maxima, ...) is
        refused in its one message (ChunkedStore.serves), when the policy is chosen."""
        if not self.store.serves(self.session, cfg):
            self._say(f"policy {self.policy} scores by column sums: reading the document again to store them")
            self.read_store_keeping_turns()

    def read_store_keeping_turns(self) -> None:
        turns = self.turns
        self.read_store()
        self.turns = turns

    def recompress(self, policy: str | None = None, budget: int | None = None, policy_args: dict | None = None,
                   progress=None):
        """Another policy or budget: nothing to read again, the next question is re-selected with the new choice."""
        new_policy, new_budget, new_args = self._new_choice(policy, budget, policy_args)
        if new_policy == "full":
            raise KvcliError("re-selection needs a compressing policy: /policy NAME N")
        fields, form_class = dict(self.__dict__), type(self)
        self.policy, self.budget, self.policy_args = new_policy, new_budget, dict(new_args)
        try:
            self._store_colsum_for(self._cfg(None))
        except BaseException:
            self.__dict__.update(fields)
            self.__class__ = form_class   # the class of the store restored with the fields
            raise
        return self.report

    def reset(self) -> None:
        """The next question starts again from the stored document: the kept turns go."""
        self.turns, self.last_reselection, self.prompt_len = [], None, 0
        if self.store is not None:
            self.store.drop_extension(self.session)   # one kept as a sequence frees it

    # ------------------------------------------------------------------ reporting
    def _mode_stats(self, s: dict) -> None:
        if self.store is not None:
            ext = self.store.extension
            s.update(store_bytes=self.store.nbytes, store_path=str(self.store.path) if self.store.path else None,
                     reselect_form=self.store.form,
                     document_read_s=round(self.store.read_s, 4),
                     stored_turn_tokens=0 if ext is None else ext.split - self.store.split,
                     stored_turns_bytes=0 if ext is None else ext.nbytes)
            if self.last_reselection is not None:
                s.update(self.last_reselection.as_stats())
        elif self.report is not None:
            s.update(self.report.as_stats())

    def _mode_row(self, s: dict) -> str:
        r = self.last_reselection
        return ("mode: re-selected per question" + self.store.streamed_note()
                + f"; document read once in {self.store.read_s:.2f}s, "
                f"cache stored: {self.store.nbytes / 1e6:.2f} MB "
                f"({self.store.path or 'in memory'}); last re-selection: "
                + ("none yet" if r is None else
                   f"{r.total_s:.2f}s (restore {r.restore_s:.2f}s of {r.restored} entries from the "
                   f"{'conversation' if r.source == 'conversation' else 'stored document'}, prefill "
                   f"{r.prefill_s:.2f}s of {r.prefilled} tokens, plan and compaction {r.plan_s:.2f}s"
                   + (f", turns kept {r.keep_s:.2f}s" if r.keep_s else "") + ")")
                + ("" if self.store.extension is None else
                   "; " + self.store.extension.describe(s["stored_turn_tokens"])))

    def summary_line(self) -> str:
        """One line after reading/loading: tokens, the store, how each question is answered."""
        n = len(self.prefix_tokens)
        label = self.policy if self.budget is None else f"{self.policy} @ {self.budget}"
        st = self.store
        where = f" in {st.path}" + ("" if st.keep else " (deleted at exit)") if st.path else " in memory"
        if self.load_s is not None:
            return (f"[{label}, re-selected per question{st.tag}] {st.describe_stored(n)} in {st.path} "
                    f"({st.nbytes / 1e6:.2f} MB; {len(self.turns)} turn(s)); loaded in {self.load_s:.2f}s "
                    f"(+ model {self.model_s:.2f}s)")
        return (f"[{label}, re-selected per question{st.tag}] {n} tokens "
                + st.describe_read(where, self.budget, self.session.n_ctx))

    def save(self, path, force: bool = True) -> int:
        """The document's stored cache and the turns: `kvcli chat --cache PATH` re-selects from it."""
        return self.store.save_as(path, self.session, [t.__dict__ for t in self.turns])

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_store(cls, path, *, compression=None, model: str | None = None, seq: int = 0,
                   n_threads: int | None = None, cache_type: str | None = None):
        """A re-selected conversation over a stored document, in the form it was stored in: a .kvc file of its full
        cache (kvcli compress --store, /save of an exact chat, or any uncompressed .kvc file) a ReselectedExact, a
        bounded store folder a ReselectedBounded (`open_store` of each); the document is not read again.

        `compression`: the compression the command built for the store's model (`store_model`), set on the
        conversation as it is (its policy, budget and arguments; its model is the one opened unless `model` is
        given); None: `full`."""
        form = "bounded" if Path(path).expanduser().is_dir() else "exact"
        return Conversation.kinds[form].open_store(path, compression=compression, model=model, seq=seq,
                                                   n_threads=n_threads, cache_type=cache_type)

    @classmethod
    def open_store(cls, path, *, compression=None, model: str | None = None, seq: int = 0,
                   n_threads: int | None = None, cache_type: str | None = None):
        """The form's store at `path` opened into a conversation of this class (`from_store` picks the form)."""
        raise NotImplementedError


class ReselectedExact(Reselected, kind="exact"):
    """Re-selected per question from the document's whole full cache, stored in a .kvc file (or in memory) and held
    resident in the context where the engine can share its cells (`resident_ok`)."""

    def _read_document(self, cfg, chunking, progress, colsum: bool | None, named: bool):
        """Read the document in one prefill and store its full cache (kvcli/drivers/reselect.py), in a context that
        holds the whole document and TURN_ROOM for the conversation (and a question's selection beside it when the
        document is resident), with the column sums the policy scores by unless `colsum` says otherwise."""
        n = len(self.prefix_tokens)
        resident = self.resident_ok()
        # resident: the document, the conversation after it and the question's selection beside it
        want = min(self.session.n_ctx_train, pad_cells(n + TURN_ROOM + (self._selection_cells() if resident else 0)))
        if self.max_cache is not None:
            want = min(want, self.max_cache)
        if self.session.cache_type != self.cache_type:   # a bounded store was read before in float16
            self.session.clear()
            self.session.use_cache_type(self.cache_type)
        n_seq = max(QUESTION_SEQS) + 1 if resident else None
        if self.session.ctx is None:
            self.session.create_context(want, n_seq=n_seq)
        elif self.session.n_ctx < want or (resident and self.session.n_seq < n_seq):
            self.session.clear()
            self.session.resize_context(max(want, self.session.n_ctx), n_seq=n_seq)
        key = self._announce("prefill", "reading it in one prefill", RESIDENT_SEQ if resident else self.seq)
        t0 = time.perf_counter()
        self.store = StoredDocument.read(self.session, self.prefix_tokens,
                                         seq=RESIDENT_SEQ if resident else self.seq, resident=resident,
                                         colsum="colsum" in cfg.observe[0] if colsum is None else colsum,
                                         path=self.store_path, keep=named,
                                         progress=progress, meta={"document": self.document, "system": self.system},
                                         # --store FILE: must be written
                                         in_memory_if_unwritable=None if named else self._say)
        doc_formats.record_read_speed(key, n, time.perf_counter() - t0)
        return CompressReport(self.policy, self.budget, n, self.store.read_s, params=cfg.params)

    def resident_ok(self) -> bool:
        """Whether the document is held resident (the native engine on a model without sliding-window layers, whose
        window cache cannot be shared up to a restore point)."""
        s = self.session
        return shares_cells(s) and not s.info.sliding_layers and self.seq not in (RESIDENT_SEQ, *QUESTION_SEQS)

    def _selection_cells(self) -> int:
        """Cells a question's selection takes beside the resident document: the budget and the policy's window."""
        return (self.budget or 0) + self._cfg(None).observe[1] + 64

    def _make_resident(self) -> None:
        """The stored document resident in RESIDENT_SEQ (restored once: from /load, or after a read of another
        engine's kind), its context grown to hold it beside a question."""
        if self.store.resident is not None:
            return
        s, n = self.session, self.store.split
        want = min(s.n_ctx_train, pad_cells(n + TURN_ROOM + self._selection_cells()))
        if s.n_seq <= max(QUESTION_SEQS) or s.n_ctx < want:
            s.clear()
            s.resize_context(max(want, s.n_ctx), n_seq=max(QUESTION_SEQS) + 1)
        self.store.make_resident(s, RESIDENT_SEQ)

    def _held_cells(self, n_prompt: int) -> int:
        return self.store.held_cells(n_prompt, self._selection_cells() if self.resident_ok() else 0)

    def _reselect(self, prompt: list[int], cfg):
        if not self.resident_ok():
            return self.store.reselect(self.session, prompt, cfg, seq=self.seq, extend=self.store_turns,
                                       window_from=self.window_from)
        try:
            return self._reselect_resident(prompt, cfg)
        except BaseException:
            self._clear_questions()
            raise

    def _reselect_resident(self, prompt: list[int], cfg):
        """The question prefilled in a question sequence over the resident document's shared cells (or the kept
        turns'), its selection gathered into the answer's sequence; the question sequence kept as the turns."""
        self._make_resident()
        self.session.clear(self.seq)   # the last answer's cache
        if not cfg.compresses(len(prompt)):   # the budget holds the whole prompt: it shares the document, uncompressed
            return self.store.reselect(self.session, prompt, cfg, seq=self.seq, window_from=self.window_from)
        ext = self.store.extension
        qseq = next(q for q in QUESTION_SEQS if ext is None or q != ext.seq)
        self.session.clear(qseq)
        r = self.store.reselect(self.session, prompt, cfg, seq=qseq, into=self.seq, extend=self.store_turns,
                                window_from=self.window_from)
        if r.dropped_seq is not None:
            self.session.clear(r.dropped_seq)
        if self.store.extension is None or self.store.extension.seq != qseq:
            self.session.clear(qseq)
        return r

    def _clear_questions(self) -> None:
        """A failed question leaves no question sequence but the kept turns'."""
        ext = self.store.extension if self.store is not None else None
        for q in QUESTION_SEQS:
            if ext is None or ext.seq != q:
                self.session.clear(q)

    @classmethod
    def open_store(cls, path, *, compression=None, model: str | None = None, seq: int = 0,
                   n_threads: int | None = None, cache_type: str | None = None):
        """A conversation over a .kvc file of a document's full cache (kvcli compress --store, /save of an exact
        chat, or any uncompressed .kvc file); `compression` as `from_store` takes it."""
        if compression is not None:
            model = model or compression.model_path
        t0 = time.perf_counter()
        f = kvc.read(path)
        kvc.check_versions(f)
        kvc.check_meta(f)
        m = f.meta
        if m["compressed"]:
            raise KvcliError(f"{path} holds a compressed cache ({m['policy']} @ {m['budget']}): --policy/--budget "
                             "re-select from a document's full cache (kvcli compress --store); drop them to use it")
        model_path = model_for(m["model"]["path"], model)
        kvc.check_model(f, model_path)
        if cache_type is not None and cache_type != m["cache_type"]:
            raise KvcliError(f"{path} holds a {m['cache_type']} cache: drop --cache-type")
        kvc.check_state(f)   # with the checks above, kvc.load_checked's: the file is read and checked once
        t1 = time.perf_counter()
        session = open_native(model_path, n_ctx=0, cache_type=m["cache_type"], flash_attn=m["flash_attn"],
                              n_threads=n_threads)
        store = StoredDocument.from_kvc(f)
        del f
        conv = cls(session, store.meta["document"], compression=compression, system=store.meta.get("system"), seq=seq,
                   reselect=True)
        # a file of `compress --store` holds the document's tokens; one of `compress --policy full` holds the
        # generic instruction after them too, whose entries are cut off at every question (StoredDocument.restore)
        if common_prefix(conv.prefix_tokens, store.tokens) < min(len(conv.prefix_tokens), store.split) - STORE_TAIL:
            raise KvcliError(f"{path}: the stored prompt does not match this model's template and tokenizer")
        conv.store = store
        cfg = conv._cfg(None)   # the command's compression
        if "colsum" in cfg.observe[0] and store.colsum is None:
            raise KvcliError(f"{path} holds no column sums, which policy '{conv.policy}' scores by: store it with "
                             "kvcli compress --store --policy " + conv.policy)
        n = len(conv.prefix_tokens)
        session.create_context(min(session.n_ctx_train, pad_cells(n + TURN_ROOM)))
        conv.model_s = time.perf_counter() - t1
        conv.turns = [Turn(**t) for t in store.meta.get("turns", [])]
        conv.report = CompressReport(conv.policy, conv.budget, n, 0.0, params=cfg.params)
        conv.load_s = t1 - t0
        return conv


def model_for(recorded, model: str | None = None) -> Path:
    """The model a stored document is opened with: `model` when given, else the one the store records (`recorded`,
    its path) when that file is here, else the default model (config, $KVCLI_MODEL, the bundled one)."""
    recorded = Path(recorded) if recorded else None
    if model is None and recorded is not None and recorded.is_file():
        return resolve_model(recorded)
    return resolve_model(model or config.get("model"))


def store_model(path, model: str | None = None):
    """The model a stored document (a .kvc file, a bounded store folder) is opened with by `from_store`: `model`
    when given, else the one it records when that file is here, else the default model. A command resolves its
    compression for it before the store is read (kvcli chat/run --cache PATH --policy P --budget N). Only the
    store's head is read here; a file that is not readable as a store is refused by from_store, its model then
    `model` or the default."""
    p = Path(path).expanduser()
    m = read_manifest(p) if p.is_dir() else kvc.peek_meta(p)
    recorded = m.get("model") if isinstance(m, dict) else None
    return model_for(recorded.get("path") if isinstance(recorded, dict) else None, model)
