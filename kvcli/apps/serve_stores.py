"""Where `kvcli serve` keeps documents' full caches between requests (kvcli/apps/serve.py, the engine, uses them):
`MemoryStore` in memory, `DiskStore` as cached entries of kvcli's document store with the engine's context as its
working set; both capped, least recently used evicted."""
from __future__ import annotations

import abc
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvcli import document_store, kvc
from kvcli.drivers.reselect import StoredDocument, common_prefix
from kvcli.drivers.reselect_bounded import ChunkedStore, read_manifest
from kvcli.errors import KvcliError
from kvcli.models import model_hash

REUSE_MIN = 64            # shared prefix below which a store is not restored (restoring a long store to keep a few
                          # tokens, a chat template's head, costs more than prefilling them)


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
    form: str = "exact"              # its record's form: "exact" (a .kvc file) or "bounded" (a store folder)


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
            self.disk[r["key"]] = _OnDisk(r["key"], tokens, bool(st.get("colsum")), r["form"])

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
            probe.form = d.form   # as the store loaded would answer: accept() asks its form
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
        if d.form == "bounded":   # its chunks stay on disk, read per request: the entry is held while it is in memory
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
            # not held in memory: the engine restores it from the file once, into the context (Residents.hold)
            del f
            doc.snapshot, doc.path, doc.keep, doc.entry = None, e.payload, True, None
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
            key = self._write(doc) if doc.form == "exact" else doc.entry.record.get("key") if doc.entry else None
            self.written += bool(doc.form == "bounded" and key)
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
            doc.path, doc.keep = old.payload, True
            if doc.resident is not None:
                doc.snapshot = None
            return key
        e = None
        try:
            e = document_store.create(form="exact", model_path=self.model_path, tokens=doc.tokens, key=key,
                                      settings=self._settings(doc), reserve=doc.nbytes)
            if doc.snapshot is None and doc.resident is not None:   # streamed from the context, a piece at a time
                doc.write_from(self.session, doc.resident, e.payload)
            else:
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
        # the file holds it now: no copy in memory (a resident document is read from the file again if the
        # context frees it); kept at close(), the document store's cap and sweep govern it
        doc.path, doc.keep = e.payload, True
        if doc.resident is not None:
            doc.snapshot = None
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
