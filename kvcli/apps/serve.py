"""The engine behind `kvcli serve`: one model, documents read once, every request answered from a cache re-selected
for it (the HTTP layer is kvcli/apps/serve_http.py).

A request's rendered prompt (its messages through the model's chat template, or a completion's text) is matched
against the stored full caches, llama-server's rule: the store whose tokens share the longest common prefix with
the prompt is restored up to that prefix, the rest of the prompt is prefilled with the policy's observation,
planned and compacted (StoredDocument.reselect, the re-selection `kvcli chat` does), and the answer is decoded
from the compressed cache:

    stored full caches       [ system + document + question 1 ][ ... ]      (on disk and in memory, LRU-capped)
    request 2's prompt       [ system + document ][ question 2 ]
                              restored ^^^^^^^^^^  ^^^^^^^^^^^^ prefilled with observation -> plan -> compact

The first request that shares no prefix of REUSE_MIN tokens with a store reads its whole prompt into a new store
(`read_in_memory`; a prompt under NEW_STORE_MIN tokens is not kept), then re-selects from it;
later requests that start with the same document (another question, another conversation, another client) restore
it instead of reading it. A re-selection that prefilled at least
NEW_STORE_MIN tokens (a new document after a shared system prompt, a long pasted answer) keeps the prompt's full
cache as a store of its own; each store also keeps the last prompt re-selected from it (its `extension`, as in
`kvcli chat`), so a conversation's next turn prefills only the last answer and the new question.

A column-sum policy (h2o, d2o) cannot restore part of a store: its sums are those of all the stored queries. Its
first request stores the prompt less its last STORE_TAIL tokens, which the same prompt again restores whole; a
request that shares only a prefix with a store (another question about the document) reads that prefix again into a
store of its own, which every later question about the document restores.

A prompt past the server's context (--ctx), or whose full cache would be above
reselect_bounded.exact_below_bytes(), is served as `kvcli chat` serves such a document: its document part (the
prompt up to the last line of its last user message, the question) is read once by bounded reading into a
ChunkedStore (kvcli/drivers/reselect_bounded.py: the chunks' entries stored, the cache never above budget + chunk),
which every request that starts with it re-selects by streaming the chunks (`ChunkedStore.reselect`). A bounded
store is never cut back: a later prompt must start with all of its tokens. Policies bounded re-selection refuses
(column sums, sliding-window models) and `full` keep the 400 `prompt too long` past the context.

Stores live behind `DocumentStore` (best match, add, touch, evict): `DiskStore` (--store disk, the default) writes
each as a `cached` entry of kvcli's document store (listed by `kvcli documents list`, capped, loaded again after a
restart) and holds a working set in memory; `MemoryStore` (--store memory) keeps them in memory only; both up to
--store-max-bytes, least recently used evicted. One model, one sequence: requests run one at a time (the HTTP
layer queues them); nothing here is thread-safe by itself.
"""
from __future__ import annotations

import abc
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from kvcli import document_store, kvc
from kvcli.drivers.chunked import DEFAULT_CHUNK, MIN_CHUNK, MIN_ROOM, keeps_positions, plan_chunking, requantises
from kvcli.drivers.reselect import STORE_TAIL, StoredDocument, common_prefix, file_snapshot
from kvcli.drivers.reselect_bounded import ChunkedStore, check_usable, exact_below_bytes, read_manifest
from kvcli.errors import KvcliError
from kvcli.evaluation.measure import peak_rss_bytes
from kvcli.generate import Sampler, Sampling, generate
from kvcli.models import model_hash
from kvcli.native.session import NativeSession
from kvcli.planning.planner import resolve

DEFAULT_CTX = 16384       # cells of the KV cache unless --ctx says (at most the model's training context)
NEW_STORE_MIN = 256       # prefilled tokens from which a re-selected prompt's full cache becomes a store of its own,
                          # and the shortest prompt read into a store (a short chat is answered without keeping it)
REUSE_MIN = 64            # shared prefix below which a store is not restored (restoring a long store to keep a few
                          # tokens, a chat template's head, costs more than prefilling them)
QUESTION_ROOM = 256       # cells a bounded store's chunks leave for what follows the document in later prompts (a
                          # longer question, a conversation's turns), besides the answer's MIN_ROOM
SPARE_SEQ = 1             # the sequence a bounded re-selection loads stored chunks through


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


# ---------------------------------------------------------------------------------- stores
class DocumentStore(abc.ABC):
    """Where full document caches are kept between requests: the interface the engine uses (an on-disk managed
    store can take MemoryStore's place)."""

    @abc.abstractmethod
    def best(self, prompt: list[int], accept=None) -> tuple[StoredDocument | None, int]:
        """The store sharing the longest common prefix (in tokens) with `prompt`, and that prefix's length; among
        the stores `accept(store, prefix)` accepts, when given."""
        ...

    @abc.abstractmethod
    def add(self, doc: StoredDocument, keep: StoredDocument | None = None) -> None:
        """Keep a new store (most recently used), evicting as the cap requires; `keep` is never evicted."""
        ...

    @abc.abstractmethod
    def touch(self, doc: StoredDocument, keep: StoredDocument | None = None) -> None:
        """`doc` was just used (its extension may have changed size): most recently used, cap enforced."""
        ...

    def attach(self, session, model_path) -> None:
        """The engine's session and model, once loaded (a store on disk writes and loads with them); optional: a
        store in memory needs neither."""
        return None

    @abc.abstractmethod
    def __contains__(self, doc) -> bool:
        ...

    @abc.abstractmethod
    def stats(self) -> dict:
        ...


def held_bytes(doc: StoredDocument) -> int:
    """What a store holds: its full cache (a bounded store: its chunk files, on disk) and the extension it keeps (the
    last prompt re-selected from it), counted against --store-max-bytes alike."""
    return doc.nbytes + (doc.extension.nbytes if doc.extension is not None else 0)


class MemoryStore(DocumentStore):
    """Stores in memory, least recently used evicted above `max_bytes` (None: no cap)."""

    def __init__(self, max_bytes: int | None):
        self.max_bytes = max_bytes
        self.docs: OrderedDict[int, StoredDocument] = OrderedDict()
        self.evicted = 0

    def best(self, prompt, accept=None):
        best, n = None, 0
        for doc in reversed(self.docs.values()):   # most recent first: it wins a tie
            k = common_prefix(doc.tokens, prompt)
            if k > n and (accept is None or accept(doc, k)):
                best, n = doc, k
        return best, n

    def add(self, doc, keep=None):
        self.docs[id(doc)] = doc
        self._evict(keep or doc)

    def touch(self, doc, keep=None):
        if id(doc) in self.docs:
            self.docs.move_to_end(id(doc))
        self._evict(keep or doc)

    def total_bytes(self) -> int:
        return sum(held_bytes(d) for d in list(self.docs.values()))   # a copy: /health reads it beside the worker

    def _evict(self, keep: StoredDocument) -> None:
        if self.max_bytes is None:
            return
        for key in list(self.docs):
            if self.total_bytes() <= self.max_bytes:
                return
            if key != id(keep):
                self.docs.pop(key).close()
                self.evicted += 1
        if self.total_bytes() > self.max_bytes and keep.extension is not None:   # alone above the cap
            keep.extension = None
        if self.total_bytes() > self.max_bytes and id(keep) in self.docs:
            self.docs.pop(id(keep)).close()
            self.evicted += 1

    def __contains__(self, doc) -> bool:
        return id(doc) in self.docs

    def stats(self) -> dict:
        return {"store_entries": len(self.docs), "store_bytes": self.total_bytes(), "store_max_bytes": self.max_bytes,
                "store_evicted": self.evicted, "store_tokens": [d.split for d in list(self.docs.values())]}


@dataclass
class _OnDisk:
    """A stored document of the document store that is not in memory: enough to match a prompt against it."""
    key: str
    tokens: np.ndarray
    colsum: bool
    bounded: bool = False


class DiskStore(DocumentStore):
    """Stores kept as `cached` entries of kvcli's document store (kvcli/document_store.py), so that they are listed
    (`kvcli documents list`), capped, expire, and outlive the server; a working set of them is held in memory (a
    MemoryStore of the same cap), from which requests restore without reading a file.

    Every store the engine adds is written at once as an entry keyed by the model, the cache type and its tokens
    (`document_store.key_of`). The entries are not held (locked) by the server: the store's cap (`max_bytes`, which
    overrides the configured one in this process) evicts the least recently used of them, and the server then drops
    its memory copy too; `kvcli documents rm` may remove one, which the server then keeps in memory only.
    A prompt whose longest common prefix is with an entry not in memory (written before a restart, or evicted from
    the working set) loads that entry into memory (`best`), when the prefix is one the engine would restore."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.memory = MemoryStore(max_bytes)
        self.keys: dict[int, str] = {}          # id(doc in memory) -> its entry's key
        self.disk: dict[str, _OnDisk] = {}      # key -> an entry not in memory
        self.session = self.model_path = self.digest = None
        self.loaded = self.written = 0

    def attach(self, session, model_path) -> None:
        """The engine's session (to write and load its stores) and model; indexes the entries it can restore from."""
        self.session, self.model_path = session, Path(model_path)
        document_store.override_max_bytes(self.max_bytes)
        self.digest = model_hash(self.model_path)
        try:
            items = document_store.entries()
        except OSError as e:
            raise KvcliError(f"cannot use the document store ({e}): set KVCLI_CACHE, or --store memory") from None
        for info in items:
            self._index(info)

    def _index(self, info) -> None:
        """List a cached entry of this model and cache type (any kvcli's store of a key: exact, or bounded) as
        loadable."""
        r = info.record
        st = r.get("settings") or {}
        if info.state != "cached" or r.get("form") not in ("exact", "bounded") or not r.get("key") or \
                r["key"] in self.disk or (r.get("model") or {}).get("hash") != self.digest or \
                st.get("cache_type") != self.session.cache_type:
            return
        if r["form"] == "bounded":
            try:
                tokens = np.asarray(read_manifest(r["path"])["tokens"], np.int32)
            except KvcliError:   # incomplete or another kvcli's: not loadable (the sweep and cap govern it)
                return
        else:
            tokens = kvc.peek_tokens(r["path"])
        if tokens is not None and len(tokens):
            self.disk[r["key"]] = _OnDisk(r["key"], tokens, bool(st.get("colsum")), r["form"] == "bounded")

    def _key(self, doc: StoredDocument) -> str:
        return document_store.key_of(self.model_path, doc.tokens, **self._settings(doc))

    def _settings(self, doc: StoredDocument) -> dict:   # StoredDocument.read's settings: its entries are alike
        return {"split": doc.split, "colsum": doc.colsum is not None, "cache_type": self.session.cache_type}

    def bounded_key(self, tokens: list[int], **settings) -> str:
        """The key a bounded store is read under (ChunkedStore.read(key=...)): it stays a cached entry."""
        return document_store.key_of(self.model_path, tokens, form="bounded", cache_type=self.session.cache_type,
                                     **settings)

    def best(self, prompt, accept=None):
        n = self.memory.best(prompt, accept)[1]
        # the entry on disk sharing a longer prefix (of those `accept` accepts), one the engine would restore
        # (REUSE_MIN), is loaded
        found, k = None, max(n, min(REUSE_MIN, len(prompt) - 1) - 1)
        for d in list(self.disk.values()):
            same = common_prefix(d.tokens, prompt)
            probe = StoredDocument(tokens=d.tokens, split=len(d.tokens), colsum=_HAS_SUMS if d.colsum else None)
            probe.bounded = d.bounded
            if same > k and (accept is None or accept(probe, same)):
                found, k = d, same
        if found is not None:
            self._load(found)
        return self.memory.best(prompt, accept)

    def _load(self, d: _OnDisk) -> None:
        del self.disk[d.key]
        e = document_store.find(d.key)
        if e is None:   # removed meanwhile (kvcli documents rm, another process's cap)
            return
        if d.bounded:   # its chunks stay on disk, read per request: the entry is held while it is in memory
            try:
                doc = ChunkedStore.open(e.payload, self.model_path)
            except KvcliError as err:
                e.release()
                print(f"kvcli serve: stored document {e.id} not loaded: {err}", file=sys.stderr, flush=True)
                return
            doc.entry, doc.keep = e, True
        else:
            try:
                f = kvc.load_checked(e.payload, self.model_path)
                doc = StoredDocument.from_kvc(f)
            except KvcliError as err:
                print(f"kvcli serve: stored document {e.id} not loaded: {err}", file=sys.stderr, flush=True)
                return
            finally:
                e.release()
            doc.snapshot, doc.path, doc.keep, doc.entry = file_snapshot(f), None, False, None
        self.loaded += 1
        self.keys[id(doc)] = d.key
        self.memory.add(doc)
        self._sync()

    def add(self, doc, keep=None):
        if keep is not None:   # used by this request: last on disk too, before the new entry's cap evicts
            self._touch_entry(keep)
        self.memory.add(doc, keep)
        if doc in self.memory:   # one above the cap alone is not written
            # a bounded store was read as a cached entry of its key already (ChunkedStore.read(key=...))
            key = self._write(doc) if not doc.bounded else doc.entry.record.get("key") if doc.entry else None
            self.written += bool(doc.bounded and key)
            if key is not None:   # else kept in memory only
                self.keys[id(doc)] = key
        self._sync()

    def _write(self, doc: StoredDocument) -> str | None:
        """Write `doc` as a cached entry (or find it there already): its key, None when it cannot be written."""
        key = self._key(doc)
        self.disk.pop(key, None)
        old = document_store.find(key)   # the same tokens stored already (touched by find)
        if old is not None:
            old.release()
            return key
        e = None
        try:
            e = document_store.create(form="exact", model_path=self.model_path, tokens=doc.tokens, key=key,
                                      settings=self._settings(doc), reserve=doc.nbytes)
            kvc.write(e.payload, doc.to_kvc(self.session, doc.snapshot.state))
        except BaseException as err:
            if e is not None:
                e.abandon()
            if not isinstance(err, (KvcliError, OSError)):
                raise
            print(f"kvcli serve: a store is kept in memory only: {err}", file=sys.stderr, flush=True)
            return None
        e.finish("cached")   # the cap enforced: least recently used entries go
        e.release()
        self.written += 1
        return key

    def touch(self, doc, keep=None):
        self.memory.touch(doc, keep)
        if doc in self.memory:
            self._touch_entry(doc)
        self._sync()

    def _touch_entry(self, doc: StoredDocument) -> None:
        """Its entry last used now, on disk too (the cap's order)."""
        key = self.keys.get(id(doc))
        e = document_store.find(key) if key is not None else None
        if e is not None:
            e.release()

    def _sync(self) -> None:
        """Memory and disk agree: a store evicted from memory stays on disk to be loaded again, one whose entry the
        cap (or anyone) removed leaves memory too."""
        on_disk = {i.record.get("key"): i for i in document_store.entries(sweep_first=False)
                   if i.state == "cached"}
        for ident, key in list(self.keys.items()):
            doc = self.memory.docs.get(ident)
            if doc is None:   # evicted from memory
                del self.keys[ident]
            elif key not in on_disk:
                self.memory.docs.pop(ident).close()
                self.memory.evicted += 1
                del self.keys[ident]
        for key in list(self.disk):
            if key not in on_disk:
                del self.disk[key]
        held = set(self.keys.values())
        for key, info in on_disk.items():
            if key not in held:
                self._index(info)

    def __contains__(self, doc) -> bool:
        return doc in self.memory

    def stats(self) -> dict:
        return {**self.memory.stats(), "store": "disk", "store_on_disk": len(self.disk) + len(self.keys),
                "store_loaded": self.loaded, "store_written": self.written}


_HAS_SUMS = np.zeros((0, 0, 0), np.float32)   # `best`'s probe of an entry on disk that has column sums


def read_in_memory(session, tokens: list[int], split: int, seq: int, colsum: bool) -> StoredDocument:
    """StoredDocument.read's prefill, kept in memory (a DiskStore writes it to the document store when it keeps
    it)."""
    t0 = time.perf_counter()
    obs = session.prefill(list(tokens[:split]), seq=seq, observe=("colsum",) if colsum else ())
    read_s = time.perf_counter() - t0
    sums = None if obs is None or obs.colsum is None else np.ascontiguousarray(obs.colsum[:, :, :split], np.float32)
    snap = session.save_seq(seq)
    session.clear(seq)
    return StoredDocument(tokens=list(tokens[:split]), split=split, colsum=sums, snapshot=snap,
                          nbytes=len(snap.state), read_s=read_s, keep=False)


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


class Stopped(KeyboardInterrupt):
    """Raised from the text callback to end a generation (a stop string, a client gone): generate() keeps the
    tokens decoded so far, as for Ctrl-C."""


@dataclass
class Answer:
    text: str
    finish_reason: str            # "stop" or "length" (OpenAI's), "cancelled" when the client left
    prompt_tokens: int
    completion_tokens: int
    stats: dict


class StopFilter:
    """Text pieces through to `emit`, holding back what could be the start of a stop string; raises Stopped at
    one (the text before it is emitted, the stop string is not)."""

    def __init__(self, stops: list[str], emit):
        self.stops, self.emit = [s for s in stops if s], emit
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.buf, self.text, self.hit = "", "", False

    def __call__(self, piece: str) -> None:
        self.buf += piece
        cut = min((i for i in (self.buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self._out(self.buf[:cut])
            self.buf, self.hit = "", True
            raise Stopped()
        safe = len(self.buf) - self.hold
        if safe > 0:
            self._out(self.buf[:safe])
            self.buf = self.buf[safe:]

    def flush(self) -> None:
        self._out(self.buf)
        self.buf = ""

    def _out(self, text: str) -> None:
        if text:
            self.text += text
            self.emit(text)


class Engine:
    """The loaded model, its one sequence and the document stores."""

    def __init__(self, model_path, *, model_id: str, n_ctx: int | None, cache_type: str, threads: int | None,
                 defaults: Choice, store: DocumentStore):
        self.session = NativeSession(model_path, n_ctx=0, cache_type=cache_type, n_threads=threads)
        limit = self.session.n_ctx_train
        # two sequences in one cell pool (kv_unified): the answer's, and SPARE_SEQ that bounded re-selection loads
        # stored chunks through (the pool is the same size as for one); one for a model with sliding-window layers,
        # which bounded re-selection does not serve
        self.session.create_context(min(n_ctx or DEFAULT_CTX, limit),
                                    n_seq=1 if keeps_positions(self.session.info) else SPARE_SEQ + 1)
        self.model_path, self.model_id = Path(model_path), model_id
        self.defaults, self.store = defaults, store
        store.attach(self.session, self.model_path)
        self.requests = 0
        self.check(defaults)   # the flags' policy resolved now, not at the first request

    def close(self) -> None:
        self.session.close()

    @property
    def n_ctx(self) -> int:
        return min(self.session.n_ctx, self.session.n_ctx_train)

    def check(self, c: Choice):
        """The policy resolved for the model (one-line BadRequest when it cannot be)."""
        try:
            return resolve(self.model_path, c.policy, c.budget, dict(c.policy_args))
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

    def fits(self, prompt: list[int]) -> bool:
        # the whole prompt is held uncompressed before its compaction, and one token more to answer
        return len(prompt) + 1 <= self.n_ctx

    def _too_long(self, prompt: list[int], why: str) -> BadRequest:
        return BadRequest(f"prompt too long: {len(prompt)} tokens, this server's context holds {self.n_ctx} "
                          "(kvcli serve --ctx N raises it, up to the model's training context "
                          f"{self.session.n_ctx_train})" + (f"; bounded reading past the context cannot serve it: "
                                                            f"{why}" if why else ""),
                          code="context_length_exceeded", param="messages")

    def plan_form(self, prompt: list[int], cfg, c: Choice) -> int | None:
        """How the prompt is served: None, the exact form (its full cache held: it fits the context); or the chunk
        size of the bounded form, where the prompt is past the context or its full cache above
        exact_below_bytes() (the rule of `kvcli chat`) and bounded re-selection can serve the policy. A prompt past
        the context that it cannot serve is refused (BadRequest), with the reason."""
        n, fits = len(prompt), self.fits(prompt)
        if fits and n * self.session.bytes_per_cell() <= exact_below_bytes():
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
            chunking = plan_chunking(n, MIN_ROOM, self.n_ctx, c.policy, c.budget,
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
        can be used), decode the answer; `on_text(piece)` streams it; `cancelled()` is asked between tokens."""
        chunk = self.check_length(prompt, c)
        cfg = self.check(c)
        t0 = time.perf_counter()
        n, seq, session = len(prompt), 0, self.session
        if chunk is not None:
            return self._answer_bounded(prompt, c, cfg, chunk, t0, on_text, cancelled)
        colsum = "colsum" in cfg.observe[0]
        exact = (lambda d, k: not d.bounded)   # a bounded store is never cut back, nor restored whole here
        found, same = self.store.best(prompt, exact)   # the longest prefix any store shares
        reuse = found is not None and same >= min(REUSE_MIN, n - 1)
        if reuse and colsum:   # a column-sum store is restored whole or not at all (its sums are all its queries')
            found, same = self.store.best(prompt, lambda d, k: d.colsum is not None and d.split <= min(k, n - 1))
            reuse = found is not None
        read_tokens, read_s = 0, 0.0
        doc = self._usable(found, same, n) if reuse else None
        fresh = doc is None
        try:   # whatever happens, the sequence is left empty for the next request
            if fresh:   # no store shares a usable prefix: read the prompt once, into a new store
                split = min(n - 1, n - STORE_TAIL)
                shared = self.store.best(prompt, exact)[1]
                if colsum and shared >= REUSE_MIN:
                    # the prefix this prompt shares with a store is a document another question asked about: stored
                    # up to the line break before it differs (a question's first words are often shared too), where
                    # every question about it can restore it whole
                    split = min(self._line_start(prompt, shared), n - 1)
                doc = read_in_memory(session, prompt, max(1, split), seq, colsum)
                read_tokens, read_s = doc.split, doc.read_s
            r = doc.reselect(session, prompt, cfg, seq=seq, extend=not fresh)
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
            st, gen, finish, t1 = self._decode_timed(c, on_text, cancelled)
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
                 "kv_cells": st["kv_cells"], "kv_bytes": st["kv_bytes"],
                 "kv_bytes_full": self.session.bytes_per_cell() * n,
                 "prompt_s": round(t1 - t0, 4), "decode_s": round(t2 - t1, 4),
                 "decode_tok_s": round(gen.decode_tok_s, 2) if gen.decode_tok_s else None,
                 "peak_rss_bytes": peak_rss_bytes(), **more, **self.store.stats()}
        return Answer(text=gen.text, finish_reason=finish, prompt_tokens=n, completion_tokens=len(gen.tokens),
                      stats=stats)

    def _answer_bounded(self, prompt: list[int], c: Choice, cfg, chunk: int, t0: float, on_text, cancelled) -> Answer:
        """A prompt served in bounded form: the bounded store whose tokens all start it is re-selected, or its
        document part (up to its question) is read into a new one first; the answer is decoded from the result."""
        n, seq, session = len(prompt), 0, self.session
        found, _ = self.store.best(prompt, lambda d, k: d.bounded and k >= d.split and d.split < n)
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

    def _decode_timed(self, c: Choice, on_text, cancelled):
        """The compressed cache's stats, then the answer decoded: (stats, generation, finish reason, when it began)."""
        st = self.session.stats(0)
        t1 = time.perf_counter()
        return (st, *self._decode(c, on_text, cancelled), t1)

    def _decode(self, c: Choice, on_text, cancelled):
        out = StopFilter(c.stop, on_text or (lambda piece: None))
        gone = [False]

        def piece(text):
            if gone[0] or out.hit:   # generate() flushes its decoder after a stop: nothing more goes out
                return
            if cancelled():
                gone[0] = True
                raise Stopped()
            out(text)

        limit = max(1, min(c.max_tokens, self.session.n_ctx - self.session.cells_used(),
                           self.session.n_ctx_train - self.session.seq(0).next_pos))
        gen = generate(self.session, limit, Sampler(c.sampling), seq=0, on_text=piece)
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
