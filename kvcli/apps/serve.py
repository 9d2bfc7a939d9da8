"""The engine behind `kvcli serve`: one model, documents read once, every request answered from a cache re-selected
for it (the HTTP layer is kvcli/apps/serve_http.py).

A request's rendered prompt (its messages through the model's chat template, or a completion's text) is matched
against the stored full caches, llama-server's rule: the store whose tokens share the longest common prefix with
the prompt is used up to that prefix. Its document is resident in the context (kvcli/drivers/resident.py: read into
a sequence of its own, or restored there once): the request's question sequence shares its cells up to that prefix
(no bytes copied), the rest of the prompt is prefilled there with the policy's observation, planned, and the plan's
entries gathered into the answer's sequence (`StoredDocument.reselect(into=...)`, kvcli_gather_plan), from which the
answer is decoded:

    context cells      [ system + document (resident) ][ question 2 ][ question 2's selection + answer ] (+ other
                                                                         requests' questions, selections, answers)
    request 2's prompt [ system + document            ][ question 2 ]
                        shared ^^^^^^^^^^^^^^^^^^^^^^  prefilled with observation -> plan -> gathered

The first request that shares no prefix of REUSE_MIN tokens with a store reads its whole prompt into a new resident
document (a prompt under NEW_STORE_MIN tokens is not kept); later requests that start with the same document
(another question, another conversation, another client) share it instead of reading it. A re-selection that
prefilled at least NEW_STORE_MIN tokens (a new document after a shared system prompt, a long pasted answer) keeps
the prompt's full cache as a store of its own; each resident document also keeps the last prompt re-selected from
it (its `extension`, a sequence sharing its cells), so a conversation's next turn prefills only the last answer and
the new question. Up to four documents are resident at once, the least recently used freed when another needs the
room (its file stays: it is restored into the context when next asked about). A model with sliding-window layers
restores the stored cache into the answer's sequence per request instead (`_answer_restored`).

A column-sum policy (observing colsum) cannot restore part of a store: its sums are those of all the stored queries. Its
first request stores the prompt less its last STORE_TAIL tokens, which the same prompt again restores whole; a
request that shares only a prefix with a store (another question about the document) reads that prefix again into a
store of its own, which every later question about the document restores.

A prompt past the server's context (--ctx), or whose full cache would be above KVCLI_RESELECT_EXACT_MB where that
is set (a prompt within the context is otherwise exact: the context is what the server was started to hold), is
served as `kvcli chat` serves such a document: its document part (the prompt up to the last line of its last user
message, the question) is read once by bounded reading into a ChunkedStore (kvcli/drivers/reselect_bounded.py: the
chunks' entries stored, the cache never above budget + chunk), which every request that starts with it re-selects
by streaming the chunks (`ChunkedStore.reselect`). A bounded store is never cut back: a later prompt must start
with all of its tokens. Policies bounded re-selection refuses (column sums, sliding-window models) and `full` keep
the 400 `prompt too long` past the context.

Stores live behind `DocumentStore` (best match, add, touch, evict): `DiskStore` (--store disk, the default) writes
each as a `cached` entry of kvcli's document store (listed by `kvcli documents list`, capped, loaded again after a
restart), its working set the documents resident in the context (none held in memory besides); `MemoryStore`
(--store memory) keeps the others as in-memory snapshots; both up to
--store-max-bytes, least recently used evicted.

Several requests in flight (kvcli/apps/serve_decode.py): `begin` does a request's matching, prefill, plan and
gather (one at a time, in the model thread) into an answer sequence of its own out of --parallel (ANSWER_SEQ first:
one request alone decodes there, as it always did), and `step` decodes one token of every request in flight in one
batch, each with its own sampler, stop strings and max_tokens; a request that ends frees its answer and question
sequences at once. Requests about one document share its cells, each with its own question and selection; requests
about other resident documents decode with them. The Scheduler's thread is the only one that calls the engine;
nothing here is thread-safe by itself.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path


from kvcli.drivers.chunked import DEFAULT_CHUNK, MIN_CHUNK, MIN_ROOM, keeps_positions, plan_chunking, requantises
from kvcli.citations import cite_prompt
from kvcli.apps.serve_stores import (REUSE_MIN, DiskStore, DocumentStore, MemoryStore,  # noqa: F401 (MemoryStore:
                                     read_in_memory)                                   # kvcli serve's to import)
from kvcli.apps.serve_decode import (Flight, ParallelDecode, RunAlone, ServeResidents, StopFilter,  # noqa: F401
                                     Stopped, WaitForRoom, text_callback)        # (Stopped: the filter's, here too)
from kvcli.drivers.reselect import STORE_TAIL, StoreMissing, StoredDocument, common_prefix
from kvcli.drivers.reselect_bounded import EXACT_ENV, ChunkedStore, check_usable, exact_below_bytes
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import peak_rss_bytes, return_freed_memory
from kvcli.generate import Decoding, Sampler, Sampling, generate
from kvcli.engines import ContextFull, open_native
from kvcli.planning.planner import resolve_once

DEFAULT_CTX = 16384       # cells of the KV cache unless --ctx says (at most the model's training context)
NEW_STORE_MIN = 256       # prefilled tokens from which a re-selected prompt's full cache becomes a store of its own,
                          # and the shortest prompt read into a store (a short chat is answered without keeping it)
QUESTION_ROOM = 256       # cells a bounded store's chunks leave for what follows the document in later prompts (a
                          # longer question, a conversation's turns), besides the answer's MIN_ROOM
SPARE_SEQ = 1             # the sequence a bounded re-selection loads stored chunks through
ANSWER_SEQ = 0            # the first answer sequence (a resident document's selection is gathered there); one
                          # request alone always decodes there
RESIDENT_SEQS = range(2, 6)   # up to four documents resident in the context at once (kvcli/drivers/resident.py)
QUESTION_START = 6        # then the question sequences: a request's prompt, prefilled with observation after the
                          # resident document's shared cells, kept as the document's extension (a conversation's next
                          # turn shares it too); one per resident document and two per request in flight (its own,
                          # and the extension it replaced, which it frees when it ends); then the other answer sequences
DEFAULT_PARALLEL = 4      # requests decoded together (--parallel)
MAX_PARALLEL = 64         # 9 + 3 * 64 sequences: within llama.cpp's LLAMA_MAX_SEQ (256)


class Prompt(list):
    """A request's prompt tokens, with `question_at()`: where its question starts (the last line of its last user
    message), asked only when a bounded store is read (it renders the prompt once more)."""

    def __init__(self, tokens, question_at=None):
        super().__init__(tokens)
        self.question_at = question_at


class BadRequest(KvcliError):
    """A request the server refuses (HTTP 400) with an OpenAI-style error code."""

    def __init__(self, message: str, code: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.code, self.param = code, param


# ---------------------------------------------------------------------------------- requests
@dataclass
class Choice:
    """What a request asks of the model, checked."""
    policy: str
    budget: int | None
    policy_args: dict
    max_tokens: int
    sampling: Sampling
    stop: list[str] = field(default_factory=list)
    cite: bool = False            # name the passages the answer came from (kvcli/citations.py): one more prefill
    window_from: str = "question"  # a window policy scores by the question's tokens, or by its whole "policy" window
    ignore_eos: bool = False      # llama-server's field: the answer runs to max_tokens


@dataclass
class Answer:
    text: str
    finish_reason: str            # "stop" or "length" (OpenAI's), "cancelled" when the client left
    prompt_tokens: int
    completion_tokens: int
    stats: dict
    citations: list | None = None   # Choice.cite: the passages, ranked (kvcli/citations.py)


class Engine(ParallelDecode):
    """The loaded model, its sequences, the document stores and the requests in flight (kvcli/apps/serve_decode.py:
    one thread calls it, the Scheduler's)."""
    context_full = ContextFull

    def __init__(self, model_path, *, model_id: str, n_ctx: int | None, cache_type: str, threads: int | None,
                 defaults: Choice, store: DocumentStore, parallel: int = DEFAULT_PARALLEL):
        if not 1 <= parallel <= MAX_PARALLEL:
            raise KvcliError(f"--parallel must be 1 to {MAX_PARALLEL}, got {parallel}")
        return_freed_memory()   # a long-running process: what one request frees is not kept in the heap
        self.session = open_native(model_path, n_ctx=0, cache_type=cache_type, n_threads=threads)
        limit = self.session.n_ctx_train
        # sequences in one cell pool (kv_unified): the answers', SPARE_SEQ that bounded re-selection loads stored
        # chunks through, the questions' and the resident documents' (the pool is the same size as for one); one for
        # a model with sliding-window layers, which neither bounded re-selection nor a resident document serves
        # (its window cache cannot be shared up to a restore point): it restores the stored cache per request, one
        # request at a time
        self.resident_ok = not keeps_positions(self.session.info)
        self.parallel = parallel if self.resident_ok else 1
        self.question_seqs = range(QUESTION_START, QUESTION_START + len(RESIDENT_SEQS) + 2 * self.parallel)
        self.answer_seqs = [ANSWER_SEQ, *range(self.question_seqs.stop, self.question_seqs.stop + self.parallel - 1)]
        n_seq = max(self.question_seqs.stop, self.answer_seqs[-1] + 1) if self.resident_ok else 1
        self.session.create_context(min(n_ctx or DEFAULT_CTX, limit), n_seq=n_seq)
        if self.session.n_seq < n_seq:
            raise KvcliError(f"the context holds {self.session.n_seq} sequences, --parallel {parallel} needs {n_seq}")
        self._init_flights()
        self.residents = ServeResidents(self.session, RESIDENT_SEQS, self.flights)
        self.model_path, self.model_id = Path(model_path), model_id
        self.defaults, self.store = defaults, store
        store.attach(self.session, self.model_path)
        self.requests = 0
        self.check(defaults)   # the flags' policy resolved now, not at the first request

    def close(self) -> None:
        self.residents.close()
        self.session.close()

    @property
    def n_ctx(self) -> int:
        return min(self.session.n_ctx, self.session.n_ctx_train)

    def check(self, c: Choice):
        """The policy resolved for the model, once per policy, budget and arguments: the request's parse and its
        answer take the same Compression (one-line BadRequest when it cannot be)."""
        try:
            return resolve_once(self.model_path, c.policy, c.budget, c.policy_args)
        except KvcliError as e:
            raise BadRequest(str(e), param="kvcli") from None

    # ------------------------------------------------------------------ prompts
    def chat_prompt(self, messages: list[dict]) -> Prompt:
        try:
            text = self.session.apply_chat_template(messages, add_assistant=True)
        except KvcliError as e:
            raise BadRequest(str(e), param="messages") from None
        tokens = self.session.tokenize(text)
        last = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last is None:
            return Prompt(tokens)

        def question_at():   # the same messages with the question (the last user message's last line) left out
            cut = [dict(m) for m in messages]
            cut[last]["content"] = _without_last_line(cut[last]["content"])
            return common_prefix(tokens, self.session.tokenize(
                self.session.apply_chat_template(cut, add_assistant=True)))
        return Prompt(tokens, question_at)

    def completion_prompt(self, text: str) -> Prompt:
        tokens = self.session.tokenize(text, add_special=True)
        return Prompt(tokens, lambda: common_prefix(tokens, self.session.tokenize(_without_last_line(text),
                                                                                  add_special=True)))

    def check_length(self, prompt: list[int], c: Choice) -> int | None:
        """Refuse (BadRequest) a prompt that cannot be served: too short, or past the context where bounded reading
        cannot serve `c`; else `plan_form`'s answer."""
        if len(prompt) < 2:   # one token to store at least, one to prefill after it
            raise BadRequest(f"the prompt is {len(prompt)} token(s): at least 2 are needed", param="prompt")
        return self.plan_form(prompt, self.check(c), c)

    def fits(self, prompt: list[int], c: Choice | None = None) -> bool:
        # the whole prompt is held uncompressed before its compaction, and one token more to answer; with a resident
        # document, its selection gathered beside it and the room an answer starts with (`_room`)
        extra = (c.budget or 0) + MIN_ROOM if self.resident_ok and c is not None else 1
        return len(prompt) + extra <= self.n_ctx

    def _too_long(self, prompt: list[int], why: str) -> BadRequest:
        return BadRequest(f"prompt too long: {len(prompt)} tokens, this server's context holds {self.n_ctx} "
                          "(kvcli serve --ctx N raises it, up to the model's training context "
                          f"{self.session.n_ctx_train})" + (f"; bounded reading past the context cannot serve it: "
                                                            f"{why}" if why else ""),
                          code="context_length_exceeded", param="messages")

    def plan_form(self, prompt: list[int], cfg, c: Choice) -> int | None:
        """How the prompt is served: None, the exact form (its full cache held: it fits the context); or the chunk
        size of the bounded form, where the prompt is past the context (or its full cache above
        KVCLI_RESELECT_EXACT_MB, where that is set) and bounded re-selection can serve the policy. A prompt past
        the context that it cannot serve is refused (BadRequest), with the reason."""
        n, fits = len(prompt), self.fits(prompt, c)
        # a prompt within the context the server was started with is served exact, its full cache resident as
        # llama-server holds it (--ctx sized it); bounded re-selection streams every chunk per question (at 30k:
        # 1.11-1.29x llama-server's time where exact took 0.76-1.05x, two runs, docs/results/serve.md).
        # KVCLI_RESELECT_EXACT_MB, set, caps it as in `kvcli chat`.
        cap = exact_below_bytes() if EXACT_ENV in os.environ else None
        if fits and (cap is None or n * self.session.bytes_per_cell() <= cap):
            return None
        if c.policy == "full":
            if fits:
                return None
            raise self._too_long(prompt, "policy 'full' keeps every entry (choose a compressing policy and budget)")
        try:
            check_usable(self.session, cfg, SPARE_SEQ)
            why = requantises(self.session.cache_type)
            if why:
                raise KvcliError(f"{why}: start the server with --cache-type f16 to serve documents longer than its "
                                 "context")
            # plan_chunking's rule: a prompt it would read in one go (a question-agnostic policy) stays exact
            chunking = plan_chunking(n, MIN_ROOM, self.n_ctx, cfg,
                                     cell_bytes=self.session.bytes_per_cell(),
                                     limit_name=f"this server's context ({self.n_ctx} cells)")
        except KvcliError as e:
            if fits:
                return None
            raise self._too_long(prompt, str(e)) from None
        if chunking.chunk is None:
            return None
        # the chunks leave room for what later prompts add after the document (held beside budget + chunk)
        chunk = min(chunking.chunk, DEFAULT_CHUNK, self.n_ctx - c.budget - QUESTION_ROOM - MIN_ROOM)
        if chunk < MIN_CHUNK:
            raise self._too_long(prompt, f"budget {c.budget} leaves {max(chunk, 0)} cells of the context to read "
                                 f"the document through (at least {MIN_CHUNK}): lower the budget or raise --ctx")
        return chunk

    # ------------------------------------------------------------------ one request
    def answer(self, prompt: list[int], c: Choice, on_text=None, cancelled=lambda: False) -> Answer:
        """Re-select a cache for `prompt` from the stores (reading it into a new one when none shares a prefix that
        can be used), decode the answer; `on_text(piece)` streams it; `cancelled()` is asked between tokens. The
        request begun and its flight stepped to its end (with any other flight: the Scheduler's loop, in one call)."""
        got = self.begin(prompt, c, on_text, cancelled)
        if not isinstance(got, Flight):
            return got
        while got.answer is None and got.error is None:
            self.step()
        if got.error is not None:
            raise got.error
        return got.answer

    def begin(self, prompt: list[int], c: Choice, on_text=None, cancelled=lambda: False,
              queued_s: float = 0.0) -> Flight | Answer:
        """Begin a request: its cache re-selected and gathered, a Flight that `step` decodes with the others (which
        frees its sequences and sets its Answer when it ends); an Answer when it was served whole (an exclusive
        form: bounded reading, a sliding-window model). Beside flights: WaitForRoom (it does not fit now) or
        RunAlone (it is served alone), nothing held (kvcli/apps/serve_decode.py)."""
        chunk = self.check_length(prompt, c)
        cfg = self.check(c)
        if self.flights and (chunk is not None or not self.resident_ok):
            raise RunAlone("served alone")
        t0 = time.perf_counter()
        n = len(prompt)
        self._prompt = prompt   # the citations' document (Choice.cite) of the forms served whole
        if chunk is not None:
            return self._answer_bounded(prompt, c, cfg, chunk, t0, on_text, cancelled)
        colsum = "colsum" in cfg.observe[0]
        exact = (lambda d, k: d.form == "exact")   # a bounded store is never cut back, nor restored whole here
        found, same = self.store.best(prompt, exact)   # the longest prefix any store shares
        reuse = found is not None and same >= min(REUSE_MIN, n - 1)
        if reuse and colsum:   # a column-sum store is restored whole or not at all (its sums are all its queries')
            found, same = self.store.best(prompt, lambda d, k: d.colsum is not None and d.split <= min(k, n - 1))
            reuse = found is not None
        if not reuse:
            found = None
        if not self.resident_ok:
            return self._answer_restored(prompt, c, cfg, found, same, t0, on_text, cancelled)
        beside = bool(self.flights)
        try:
            f = self._begin_resident(prompt, c, cfg, found, same, t0, on_text, cancelled)
        except (WaitForRoom, RunAlone, BadRequest):
            raise
        except KvcliError:
            if beside:   # the room fell short beside the flights (a cell-hungry plan): alone it fits, or says why not
                raise RunAlone("served alone") from None
            raise
        f.queued_s = queued_s
        return f

    def _room(self, prompt: list[int], split: int, c: Choice) -> int:
        """Cells a request needs beside its resident document: the prompt after it, the selection, an answer."""
        return len(prompt) - split + (c.budget or 0) + MIN_ROOM

    def _begin_resident(self, prompt: list[int], c: Choice, cfg, found, same: int, t0: float, on_text,
                        cancelled) -> Flight:
        """The document resident in the context (read into it, or restored into it once): the prompt shares its
        cells up to the restore point, the rest is prefilled with observation into a question sequence, the plan
        gathered into an answer sequence of the request's own, from which `step` decodes the answer
        (kvcli/drivers/resident.py). Beside flights, the room counts their reserved answers and this one's whole."""
        n, session, colsum = len(prompt), self.session, "colsum" in cfg.observe[0]
        beside, extra = bool(self.flights), 0
        if beside:   # a sequence of each kind free, else wait; the whole answer and the flights' reserved
            if len(self._kept_questions()) >= len(self.question_seqs):
                raise WaitForRoom("no question sequence is free")
            self._answer_seq()
            extra = self.reserved() + max(0, min(c.max_tokens, session.n_ctx_train - n) - MIN_ROOM)
        read_tokens, read_s, doc = 0, 0.0, None
        room = self._room(prompt, min(same, found.split), c) if found is not None else 0
        if found is not None and not beside and found.split + room > session.n_ctx:
            # held whole, the stored document that shares the prompt's head would leave the rest no room in the
            # context (another version of a long document): the prompt is read alone, as if none shared it
            found = None
        if found is not None:
            try:
                room += extra
                if beside and found in self.residents:
                    self.residents.room_beside(room, keep=found)
                self.residents.hold(found, room)
                doc = self._usable(found, same, n)
            except StoreMissing:   # its file went (the document store's cap, `kvcli documents rm`): read again
                found.close()
                found = None
        fresh = doc is None
        stored = r = None
        qseq, aseq = self._question_seq(), self._answer_seq()
        try:   # whatever fails, the request's sequences are left empty
            if fresh:   # no store shares a usable prefix: the prompt read once, into a new resident document
                split = self._fresh_split(prompt, colsum)
                doc = self.residents.read(prompt, split, colsum, self._room(prompt, split, c) + extra)
                read_tokens, read_s = doc.split, doc.read_s
            r = doc.reselect(session, prompt, cfg, seq=qseq, into=aseq, extend=not fresh,
                             window_from=self._window_from(c, fresh))
            if fresh:
                if n >= NEW_STORE_MIN:
                    self.store.add(doc)
                    stored = doc
                else:   # a short prompt is not kept
                    doc.close()
            else:
                if r.prefilled >= NEW_STORE_MIN and r.seq != qseq:
                    # a long new part (another document after a shared head): the prompt's full cache, the shared
                    # cells and the question's, becomes a store too (restored into the context when next used)
                    snap = session.save_seq(qseq)
                    stored = StoredDocument(tokens=list(prompt), split=n, snapshot=snap, nbytes=len(snap.state),
                                            keep=False)
                    self.store.add(stored, keep=found)
                if found in self.store:
                    self.store.touch(found, keep=found)
            if r.seq == qseq:
                # nothing gathered (policy full, a prompt within the budget): the answer decodes from a sequence of
                # its own sharing the prompt's cells, so that what frees the question's sequence beside other
                # requests (another question's extension replacing it, a store evicted) leaves its cache whole
                session.share(qseq, aseq, n)
                a = session.seq(aseq)
                a.last_logits, a.logits_index = session.logits(qseq), 0   # share() starts it without logits
            st = session.stats(aseq)
        except BaseException:
            if fresh and doc is not None and doc not in self.store:
                doc.close()
            session.clear(aseq)
            for q in {qseq, getattr(r, "dropped_seq", None)} - {None}:
                self._free_question(q)
            raise
        owned = {qseq}
        if r.dropped_seq is not None and not any(r.dropped_seq in g.owned for g in self.flights.values()):
            owned.add(r.dropped_seq)   # the extension it replaced: freed when it ends (a request alone freed it so)
        out = StopFilter(c.stop, on_text or (lambda piece: None))
        gone = [False]
        f = Flight(prompt=prompt, choice=c, seq=aseq, qseq=qseq, doc=doc, r=r, st=st, t0=t0,
                   t1=time.perf_counter(), cancelled=cancelled, out=out, gone=gone, fresh=fresh,
                   read=(read_tokens, read_s), new_store=stored.split if stored else 0, owned=owned)
        f.make = lambda limit: Decoding(session, limit, Sampler(c.sampling), seq=aseq,
                                        on_text=text_callback(out, cancelled, gone), ignore_eos=c.ignore_eos)
        self.flights[aseq] = f
        self._unpark(f, f.make)
        return f

    def _end(self, f: Flight) -> None:
        """A flight's answer ended: its citations while its sequence holds the answer, its sequences freed (its
        question's kept where it is a document's extension), its Answer built."""
        gen = f.decoding.result
        c, session = f.choice, self.session
        try:
            if f.error is None:
                if not f.out.hit and not f.gone[0]:
                    f.out.flush()
                gen.text = f.out.text
                finish = "cancelled" if f.gone[0] else "stop" if gen.stopped == "eog" or f.out.hit else "length"
                if c.cite and finish != "cancelled":
                    self._cite(gen, f.seq, f.prompt)
        finally:
            del self.flights[f.seq]
            self.ended += 1
            session.clear(f.seq)
            for q in f.owned:
                self._free_question(q)
        if f.error is not None:
            return
        more = {"queued_s": round(f.queued_s, 4),
                "decoded_with": round(f.together / f.steps, 2) if f.steps else None, "decoded_with_most": f.most}
        f.answer = self._answered(c, len(f.prompt), gen, finish, f.r, f.st, (f.t0, f.t1, time.perf_counter()),
                                  fresh=f.fresh, read=f.read, new_store=f.new_store,
                                  resident_documents=len(self.residents.docs), resident_cells=self.residents.cells(),
                                  resident_freed=self.residents.freed, **more)

    @staticmethod
    def _window_from(c: Choice, fresh: bool) -> str:
        """A document read by this request is scored by the policy's whole window, as `kvcli run` scores it (the
        few document tokens it reaches into cost nothing beside the read); a later request by its choice."""
        return "policy" if fresh else c.window_from

    def _kept_questions(self) -> set[int]:
        """Question sequences in use: documents' extensions, and those flights own."""
        kept = {d.extension.seq for d in self.residents.docs.values() if d.extension is not None}
        return kept.union(*(f.owned for f in self.flights.values()))

    def _question_seq(self) -> int:
        """A sequence for a request's prompt: one no resident document keeps as its extension, no flight owns."""
        kept = self._kept_questions()
        for q in self.question_seqs:
            if q not in kept:
                self.session.clear(q)
                return q
        if self.flights:
            raise WaitForRoom("no question sequence is free")
        raise KvcliError("no sequence is free for the request's prompt")

    def _answer_seq(self) -> int:
        """The first answer sequence no flight decodes from (ANSWER_SEQ for a request alone)."""
        for a in self.answer_seqs:
            if a not in self.flights:
                return a
        raise WaitForRoom("every answer sequence is decoding")

    def _free_question(self, q: int) -> None:
        """Free question sequence `q` unless a document keeps it as its extension or a flight still owns it."""
        if q not in self._kept_questions():
            self.session.clear(q)

    def _fresh_split(self, prompt: list[int], colsum: bool) -> int:
        """Where a new store of `prompt` ends: STORE_TAIL tokens before its end; for a column-sum policy, when the
        prompt shares a prefix with a store (a document another question asked about), at the line break before
        it differs (a question's first words are often shared too), where every question about it can restore it
        whole."""
        n = len(prompt)
        split = min(n - 1, n - STORE_TAIL)
        exact = (lambda d, k: d.form == "exact")
        shared = self.store.best(prompt, exact)[1]
        if colsum and shared >= REUSE_MIN:
            split = min(self._line_start(prompt, shared), n - 1)
        return max(1, split)

    def _answer_restored(self, prompt: list[int], c: Choice, cfg, found, same: int, t0: float, on_text,
                         cancelled) -> Answer:
        """A model with sliding-window layers: the stored cache restored into the answer's sequence per request,
        compacted in place (StoredDocument.reselect without a resident document)."""
        n, seq, session, colsum = len(prompt), ANSWER_SEQ, self.session, "colsum" in cfg.observe[0]
        read_tokens, read_s = 0, 0.0
        doc = self._usable(found, same, n) if found is not None else None
        fresh = doc is None
        try:   # whatever happens, the sequence is left empty for the next request
            if fresh:   # no store shares a usable prefix: read the prompt once, into a new store
                doc = read_in_memory(session, prompt, self._fresh_split(prompt, colsum), seq, colsum)
                read_tokens, read_s = doc.split, doc.read_s
            r = doc.reselect(session, prompt, cfg, seq=seq, extend=not fresh, window_from=self._window_from(c, fresh))
            stored = None
            if fresh:
                if n >= NEW_STORE_MIN:
                    self.store.add(doc)
                    stored = doc
            else:
                if r.prefilled >= NEW_STORE_MIN and doc.extension is not None:
                    # a long new part (another document after a shared head): its full cache becomes a store too
                    ext, doc.extension = doc.extension, None
                    stored = StoredDocument(tokens=ext.tokens, split=ext.split, colsum=ext.colsum,
                                            snapshot=ext.snapshot, nbytes=ext.nbytes, keep=False)
                    self.store.add(stored, keep=found)
                if found in self.store:
                    self.store.touch(found, keep=found)
            st, gen, finish, t1 = self._decode_timed(c, on_text, cancelled, seq=seq)
        finally:
            session.clear(seq)
        return self._answered(c, n, gen, finish, r, st, (t0, t1, time.perf_counter()), fresh=fresh,
                              read=(read_tokens, read_s), new_store=stored.split if stored else 0)

    def _answered(self, c: Choice, n: int, gen, finish: str, r, st: dict, times, *, fresh: bool, read, new_store,
                  **more) -> Answer:
        t0, t1, t2 = times
        self.requests += 1
        stats = {"policy": c.policy, "budget": c.budget, "prompt_tokens": n,
                 "document_read_tokens": read[0], "document_read_s": round(read[1], 4),
                 "prefix_reused_tokens": 0 if fresh else r.restored, "prefilled_tokens": r.prefilled,
                 "restored_from": "new store" if fresh else r.source, "new_store_tokens": new_store,
                 **{k: v for k, v in r.as_stats().items() if k.endswith("_s")},   # restore, prefill, plan, keep
                 "window": getattr(r, "window", None), "kv_cells": st["kv_cells"], "kv_bytes": st["kv_bytes"],
                 "kv_bytes_full": self.session.bytes_per_cell() * n,
                 "prompt_s": round(t1 - t0, 4), "decode_s": round(t2 - t1, 4),
                 "decode_tok_s": round(gen.decode_tok_s, 2) if gen.decode_tok_s else None,
                 "peak_rss_bytes": peak_rss_bytes(), **more, **self.store.stats()}
        return Answer(text=gen.text, finish_reason=finish, prompt_tokens=n, completion_tokens=len(gen.tokens),
                      stats=stats, citations=getattr(gen, "citations", None))

    def _answer_bounded(self, prompt: list[int], c: Choice, cfg, chunk: int, t0: float, on_text, cancelled) -> Answer:
        """A prompt served in bounded form: the bounded store whose tokens all start it is re-selected, or its
        document part (up to its question) is read into a new one first; the answer is decoded from the result."""
        n, seq, session = len(prompt), 0, self.session
        self.residents.close()   # a document past the context: the resident ones leave it the whole context
        found, _ = self.store.best(prompt, lambda d, k: d.form == "bounded" and k >= d.split and d.split < n)
        fresh = found is None
        read_tokens, read_s = 0, 0.0
        doc = found
        split = self._document_end(prompt) if fresh else found.split
        # held at once: the kept entries and a chunk (the larger of the read's and this budget's), beside the rest
        cap = c.budget + chunk if fresh else max(found.cap, c.budget + found.chunk)
        if n - split + cap + 1 > self.n_ctx:
            raise BadRequest(f"the prompt's {n - split} tokens after its document, held beside its budget and a "
                             f"chunk of the document ({cap} cells), do not fit this server's context "
                             f"({self.n_ctx} cells): raise --ctx", code="context_length_exceeded", param="messages")
        try:   # whatever happens, the sequences are left empty for the next request
            if fresh:
                key = self.store.bounded_key(prompt[:split], split=split, chunk=chunk, policy=c.policy,
                                             budget=c.budget, params=cfg.spec.render(cfg.params)) \
                    if isinstance(self.store, DiskStore) else None
                doc = ChunkedStore.read(session, prompt, cfg, chunk, cap=c.budget + chunk, split=split, seq=seq,
                                        spare=SPARE_SEQ, key=key)
                read_tokens, read_s = doc.split, doc.read_s
            r = doc.reselect(session, prompt, cfg, seq=seq, spare=SPARE_SEQ, extend=not fresh)
            if fresh:
                self.store.add(doc)
            elif found in self.store:
                self.store.touch(found, keep=found)
            st, gen, finish, t1 = self._decode_timed(c, on_text, cancelled)
        except BaseException:
            if fresh and doc is not None and doc not in self.store:
                doc.close()
            raise
        finally:
            session.clear(seq)
        return self._answered(c, n, gen, finish, r, st, (t0, t1, time.perf_counter()), fresh=fresh,
                              read=(read_tokens, read_s), new_store=doc.split if fresh else 0,
                              bounded_chunks=len(doc.chunks), bounded_chunk=doc.chunk)

    def _document_end(self, prompt: list[int]) -> int:
        """Where a bounded store of this prompt ends: before its question (the last line of its last user message),
        so that another question about the same document starts with all of the store's tokens; the prompt less
        STORE_TAIL tokens when the question cannot be told."""
        n = len(prompt)
        at = getattr(prompt, "question_at", None)
        k = at() if at is not None else 0
        return k if REUSE_MIN <= k <= n - STORE_TAIL else max(1, n - STORE_TAIL)

    def _line_start(self, tokens: list[int], upto: int) -> int:
        """The position after the last token of tokens[:upto] that holds a line break (upto when none is near)."""
        for i in range(upto - 1, max(0, upto - 256), -1):
            if b"\n" in self.session.token_bytes(tokens[i]):
                return i + 1
        return upto

    def _usable(self, doc: StoredDocument, same: int, n: int) -> StoredDocument:
        """`doc`, or a view of it, that re-selection can restore `same` tokens of for an n-token prompt."""
        if doc.colsum is not None and doc.split <= same and doc.split < n:
            return doc   # whole: a column-sum policy needs it so, the others cut it back as they need
        if min(same, doc.split) >= n:   # the prompt ends inside the store (a repeated prompt): its last token is
            # prefilled again for its logits, from a view of the store cut before it
            return replace(doc, tokens=doc.tokens[:n - 1], split=n - 1, colsum=None, extension=None, keep=True)
        return doc

    def _decode_timed(self, c: Choice, on_text, cancelled, seq: int = ANSWER_SEQ):
        """The compressed cache's stats, then the answer decoded: (stats, generation, finish reason, when it began)."""
        st = self.session.stats(seq)
        t1 = time.perf_counter()
        gen, finish = self._decode(c, on_text, cancelled, seq)
        if c.cite and finish != "cancelled":   # while `seq` still holds the answer
            self._cite(gen, seq, self._prompt)
        return st, gen, finish, t1

    def _cite(self, gen, seq: int, prompt: list[int]) -> None:
        """gen.citations: the passages of `prompt`'s document the answer in `seq` came from (Choice.cite)."""
        try:
            gen.citations = cite_prompt(self.session, seq, gen.tokens, prompt).as_json()
        except KvcliError as e:
            gen.citations = []   # nothing to cite from (the reason is the log's)
            print(f"kvcli serve: no citations: {e}", file=sys.stderr, flush=True)

    def _decode(self, c: Choice, on_text, cancelled, seq: int = ANSWER_SEQ):
        out = StopFilter(c.stop, on_text or (lambda piece: None))
        gone = [False]
        piece = text_callback(out, cancelled, gone)
        limit = max(1, min(c.max_tokens, self.session.n_ctx - self.session.cells_used(),
                           self.session.n_ctx_train - self.session.seq(seq).next_pos))
        gen = generate(self.session, limit, Sampler(c.sampling), seq=seq, on_text=piece, ignore_eos=c.ignore_eos)
        if not out.hit and not gone[0]:
            out.flush()
        gen.text = out.text
        if gone[0]:
            return gen, "cancelled"
        return gen, "stop" if gen.stopped == "eog" or out.hit else "length"


def _without_last_line(text: str) -> str:
    """`text` up to its last line (what `Engine.chat_prompt` takes for the question), '' when it is one line."""
    body = text.rstrip()
    return body[:body.rfind("\n") + 1]
