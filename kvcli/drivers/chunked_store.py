"""A bounded store: a document's entries stored chunk by chunk as bounded reading reads it, the cache never holding
more than the entries kept so far + one chunk (`BoundedStore.read`), every chunk's entries saved to the store after
its prefill, before the compaction, so the store is written chunk by chunk and never costs the full cache in RAM.
Bounded re-selection (kvcli/drivers/reselect_bounded.py: `ChunkedStore`, this store with `reselect`) streams the
stored chunks for every question.

The read is resumable: after every chunk its files and the cache carried to the next chunk are on disk and recorded in
the document store; a read stopped by Ctrl-C, SIGTERM, SIGHUP or a crash is continued by the same read (`read`).

The store is a folder: one file per chunk (an uncompressed cache state of the chunk's cells, kvcli/native/state.py;
with `--cache-type q8_0` its rows are q8_0, quantised once from the float16 cache the document is read in:
`store_types`),
its block index (`index-NNNN.npz`), the reading's last kept cache (`summary.state`) and `store.json` (the model it is
bound to, kvcli's and the native state's versions, the tokens, the document, the
conversation's turns, the chunks with each file's size and SHA-256, and the SHA-256 of store.json itself), written to
a `.part` folder and renamed when the reading is done (a store it replaces is moved aside first and removed after).
It is a first-class stored document, as a `.kvc` file of the exact form is: `kvcli chat --store DIR` and
`kvcli compress --store -o DIR` keep it, `/save DIR` of a bounded chat writes one, and `kvcli run/chat --cache DIR
--policy P --budget N` re-select from it without reading the document (`BoundedStore.open`). A store folder that is
another model's, another kvcli's, or whose store.json or a chunk file is gone, truncated or changed is refused in
one line, at opening (every chunk is checked) and again for each chunk a question reads.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcli import document_store, kvc, outfile
from kvcli.drivers import block_index
from kvcli.drivers.chunked import keeps_positions, probe_length, read_in_chunks, requantises
from kvcli.drivers.reselect import STORE_TAIL, StoreMissing
from kvcli.errors import KvcliError
from kvcli.engines import F16, Q8_0, SeqSnapshot, cells_from, convert_chunk, shares_cells
from kvcli.planning.planner import Compression

# 3: the block index and the reading's last kept cache; 2: store.json carries its own SHA-256 and the conversation's
# turns (1: temporary stores only). A format 2 store is read as it was: every chunk streamed for every question.
FORMAT = 3
READS = (2, 3)
MANIFEST = "store.json"
SUMMARY = "summary.state"
_CHUNK_FILE = re.compile(r"chunk-[0-9]{4,}\.state")
_INDEX_FILE = re.compile(r"index-[0-9]{4,}\.npz")


@dataclass
class StoredChunk:
    first_token: int        # its first token in the stored tokens
    n: int                  # tokens (= cells) in it
    first_pos: int          # the position its first entry had when it was read
    file: str               # its state file in the store folder
    sha256: str
    nbytes: int




@dataclass
class BoundedStore:
    """A document's entries stored chunk by chunk (see the module doc): read once (`read`) or opened again (`open`),
    saved elsewhere (`save_as`), `close`d. Its re-selection per question: reselect_bounded.ChunkedStore."""
    tokens: list[int]
    split: int
    chunk: int
    chunks: list[StoredChunk]
    path: Path                       # the store folder
    keep: bool = False
    read_s: float = 0.0              # the read's seconds, an interrupted read's part included
    resumed_tokens: int = 0          # tokens an interrupted read had stored before this process continued it
    cap: int = 0                     # most cells a question's re-selection holds (kept + a chunk + its probe)
    read_policy: str = ""            # the policy and budget the document was read with
    read_budget: int = 0
    meta: dict = field(default_factory=dict)
    colsum = None                    # never stored: column-sum policies are refused
    entry: object = None             # its kvcli.document_store.Entry, held while this process uses the folder
    pages: list = field(default_factory=list)   # the block index: one {"file", "sha256", "nbytes"} per chunk
    page: int = 0                    # its tokens per page (0: no index)
    summary: dict | None = None      # the reading's last kept cache: {"file", "sha256", "nbytes", snapshot fields}
    chunk_type: str = "f16"          # the rows of the chunk files: the cache's type, or q8_0 from a float16 read

    @property
    def nbytes(self) -> int:
        """The store's files but store.json: its chunks, their block index and the summary."""
        return sum(c.nbytes for c in self.chunks) + sum(f["nbytes"] for f in self.pages) + \
            (self.summary["nbytes"] if self.summary else 0)

    # ------------------------------------------------------------------ reading once
    @classmethod
    def read(cls, session, tokens: list[int], cfg: Compression, chunk: int, *, cap: int | None = None,
             split: int | None = None, seq: int = 0, spare: int | None = None, path=None, keep: bool = False,
             progress=None, meta: dict | None = None, key: str | None = None, notify=None,
             index: bool = True, chunk_type: str | None = None) -> "BoundedStore":
        """Read tokens[:split] into `seq` by bounded reading with `cfg` and chunks of `chunk` tokens, storing every
        chunk's entries (and, `index`, its block index: kvcli/drivers/block_index.py); the sequence is cleared
        afterwards. `spare`: a second sequence of the context, used per question to load a chunk through
        (append_saved). `key` (no `path`): the store stays in the document store after close() as a `cached` entry
        of that key, for `document_store.find(key)`. `chunk_type` (default: the session's cache type): the
        chunk files' rows, q8_0 from a float16 session (`store_types`).

        Resumable: after every chunk the chunk's files and the cache carried to the next chunk (the kept entries,
        `carry-NNNN.state`) are on disk and recorded in the document store's entry. A read stopped by Ctrl-C, SIGTERM
        or SIGHUP leaves its entry `partial` (a crash too: the next sweep marks it), and reading the same document
        again (the same model file, tokens, settings and target) continues after its last whole chunk, every file
        checked (`notify` says so in a line; a partial read that does not check out is removed and the read starts
        over, said too). `progress(n)` counts tokens read; its `skip(n)`, when it has one, the tokens resumed."""
        spare = seq + 1 if spare is None else spare
        check_usable(session, cfg, spare)
        why = requantises(session.cache_type)
        if why:
            raise KvcliError(f"{why}: a bounded store is read in a float16 cache (store_types)")
        chunk_type = chunk_type or session.cache_type
        if store_types(chunk_type) != (session.cache_type, chunk_type):
            raise KvcliError(f"a store of {chunk_type} chunks is read in a {store_types(chunk_type)[0]} cache, "
                             f"not {session.cache_type}")
        cap = cap or cfg.budget + chunk
        split = max(1, len(tokens) - STORE_TAIL) if split is None else int(split)
        if not 0 < split <= len(tokens):
            raise KvcliError(f"cannot store {split} of {len(tokens)} tokens")
        if path is not None:
            path = check_store_target(path, form="bounded")
        index = index and block_index.usable(session.info) is None
        settings = {"split": split, "chunk": chunk, "cap": cap, "policy": cfg.policy, "budget": cfg.budget,
                    "params": cfg.spec.render(cfg.params), "cache_type": session.cache_type, "chunk_type": chunk_type,
                    "index": block_index.PAGE if index else 0}
        say = notify or (lambda line: None)
        # an entry of the document store (kvcli/document_store.py) from now on: whatever ends this process, what it
        # wrote is listed (a partial read, with what resuming it needs) or removed by the next kvcli
        entry = document_store.resume(form="bounded", model_path=session.model_path, tokens=tokens[:split],
                                      kept_path=path, key=key, settings=settings)
        resumed = _Resumed.check(entry) if entry is not None else None
        if entry is not None and resumed is None:
            say(f"a partial read of this document ({entry.id}) did not check out: reading it from the start")
            entry.abandon()
            entry = None
        if entry is None:
            entry = document_store.create(
                form="bounded", model_path=session.model_path, tokens=tokens[:split], kept_path=path, key=key,
                settings=settings, reserve=0 if keep else split * session.bytes_per_cell())
        cached = key is not None and path is None   # stays in the document store after close()
        path = Path(path) if path is not None else entry.payload
        part = path.with_name(path.name + ".part")
        chunks: list[StoredChunk] = list(resumed.chunks) if resumed else []
        pages: list[dict] = list(resumed.pages) if resumed else []
        carry = dict(resumed.carry) if resumed else None
        done = False
        stopped = False

        def save(first_pos: int, n: int) -> None:   # the chunk just prefilled, before its compaction
            state, cells, end = cells_from(session.save_seq(seq).state, first_pos)
            if cells != n or end != first_pos + n:
                raise KvcliError(f"chunk {len(chunks)}: {cells} cells up to position {end} saved, {n} read")
            if chunk_type != session.cache_type:   # quantised once, in the model's space (kvcli/native/state.py)
                state = convert_chunk(state, CHUNK_TYPES[chunk_type])
            name = f"chunk-{len(chunks):04d}.state"
            outfile.write(part / name, [state])
            first_token = chunks[-1].first_token + chunks[-1].n if chunks else 0
            chunks.append(StoredChunk(first_token, n, first_pos, name, hashlib.sha256(state).hexdigest(), len(state)))
            if index:
                data = block_index.chunk_pages(session, seq, first_pos, n)
                pages.append(_file_record(part, f"index-{len(pages):04d}.npz", data))

        def carried(cells: int) -> None:   # the chunk compacted: the kept entries, what the next chunk reads beside
            nonlocal carry
            snap = session.save_seq(seq)
            old = carry
            carry = {**_file_record(part, f"carry-{len(chunks) - 1:04d}.state", snap.state), **_snap_fields(snap)}
            entry.update(chunks_done=[vars(c) for c in chunks], pages_done=list(pages), carry=carry,
                         read_s=read_before + time.perf_counter() - t0, last_used=time.time())
            if old is not None and old["file"] != carry["file"]:
                (part / old["file"]).unlink(missing_ok=True)

        try:
            if seq in session.seqs:
                session.clear(seq)
            read_before, done_tokens = 0.0, 0
            if resumed:
                read_before, done_tokens = resumed.read_s, sum(c.n for c in chunks)
                session.restore_seq(resumed.snapshot(part), seq)
                say(f"resuming an interrupted read: {len(chunks)} chunks ({done_tokens} of {split} tokens) were "
                    f"stored by it ({entry.id}), checked")
                if progress is not None:
                    getattr(progress, "skip", progress)(done_tokens)
            else:
                shutil.rmtree(part, ignore_errors=True)
                part.mkdir(parents=True)
            # each question's probe (chunked.question_probe) will be held beside a chunk: the chunks leave it room
            room = probe_length(cfg.observe[1], chunk) if "window" in cfg.observe[0] else 0
            t0 = time.perf_counter()
            if done_tokens < split:
                read_in_chunks(session, list(tokens[done_tokens:split]), cfg, chunk - room, cap=cap - room,
                               seq=seq, progress=progress, scoring="chunk", on_prefilled=save, on_cache=carried)
            read_s = read_before + time.perf_counter() - t0
            session.clear(seq)
            store = cls(tokens=list(tokens[:split]), split=split, chunk=chunk, chunks=chunks, path=path, keep=keep,
                        read_s=read_s, resumed_tokens=done_tokens, cap=cap, read_policy=cfg.policy,
                        read_budget=cfg.budget, meta=dict(meta or {}), pages=pages, chunk_type=chunk_type,
                        page=block_index.PAGE if index else 0)
            if carry is not None:   # the read's last kept cache: the summary a question's queries attend to
                os.replace(part / carry["file"], part / SUMMARY)
                store.summary = {**carry, "file": SUMMARY}
            for f in part.glob("carry-*.state"):   # one a stop left between writing it and recording it
                f.unlink()
            write_manifest(part, store.manifest(session))
            replace_folder(part, path)
            entry.finish("kept" if keep else "cached" if cached else "temporary")
            store.entry, store.keep = entry, keep or cached
            done = True
            return store
        except KeyboardInterrupt:   # Ctrl-C, SIGTERM, SIGHUP (kvcli/cli.py): what was read stays, to be resumed
            stopped = bool(chunks) and carry is not None
            raise
        finally:
            if not done and stopped:
                entry.suspend()
            elif not done:   # an error: nothing of the read stays
                shutil.rmtree(part, ignore_errors=True)
                entry.abandon()

    def manifest(self, session, turns: list | None = None) -> dict:
        meta = {"document": self.meta.get("document", ""), "system": self.meta.get("system"),
                "turns": list(self.meta.get("turns", []) if turns is None else turns)}
        return {"kvcli_store": FORMAT, **kvc.base_meta(session), "split": self.split, "chunk": self.chunk,
                "read_policy": self.read_policy, "read_budget": self.read_budget, "read_s": round(self.read_s, 3),
                "chunk_type": self.chunk_type,
                "tokens": [int(t) for t in self.tokens], "meta": meta,
                "chunks": [vars(c) for c in self.chunks],
                "index": {"page": self.page, "files": list(self.pages)} if self.pages else None,
                "summary": self.summary}

    # ------------------------------------------------------------------ a kept store, opened again
    @classmethod
    def open(cls, path, model_path=None, manifest: dict | None = None) -> "BoundedStore":
        """A store folder written before (kvcli chat --store DIR, kvcli compress --store -o DIR, /save DIR),
        checked as a .kvc file is: store.json whole and of this kvcli and native state format
        (`read_manifest`), made for the model at `model_path` (when given), and every chunk file present, of its
        recorded size and SHA-256. Refused in one line otherwise. The folder is kept at close()."""
        path = Path(path)
        m = read_manifest(path) if manifest is None else manifest
        if model_path is not None:
            kvc.check_model(_Named(m, path), model_path)
        chunks = [StoredChunk(**c) for c in m["chunks"]]
        index = m.get("index") or {}
        store = cls(tokens=list(m["tokens"]), split=m["split"], chunk=m["chunk"], chunks=chunks, path=path,
                    keep=True, read_s=float(m["read_s"]), cap=m["chunk"] + m["read_budget"],
                    read_policy=m["read_policy"], read_budget=m["read_budget"], meta=dict(m["meta"]),
                    pages=list(index.get("files") or []), page=int(index.get("page") or 0), summary=m.get("summary"),
                    chunk_type=m.get("chunk_type", m["cache_type"]))
        for c in chunks:
            store._read_chunk(c)
        for f in store.pages + ([store.summary] if store.summary else []):
            store._read_file(f)
        store.entry = document_store.use_path(path)   # a listed store: in use now, and used now
        return store

    def save_as(self, path, session, turns: list | None = None) -> int:
        """Write the store (its chunk files, checked as they are copied, and the conversation's turns) to the
        folder `path` (/save of a bounded chat); returns its size in bytes. The same folder is rewritten in place."""
        path = check_store_target(path, form="bounded")
        part = path.with_name(path.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir()
        done = False
        try:
            size = 0
            for c in self.chunks:
                size += outfile.write(part / c.file, [self._read_chunk(c)])
            for f in self.pages + ([self.summary] if self.summary else []):
                size += outfile.write(part / f["file"], [self._read_file(f)])
            size += write_manifest(part, self.manifest(session, turns))
            replace_folder(part, path)
            done = True
            document_store.register_kept(path, form="bounded", model_path=session.model_path, tokens=self.tokens)
            return size
        finally:
            if not done:
                shutil.rmtree(part, ignore_errors=True)

    # ------------------------------------------------------------------ per question
    def _read_chunk(self, c: StoredChunk) -> bytes:
        """A chunk file's bytes, refused in one line when it is gone, truncated or changed."""
        f = self.path / c.file
        try:
            state = f.read_bytes()
        except FileNotFoundError:
            if not (self.path / MANIFEST).exists():
                raise StoreMissing(f"the stored document cache {self.path} is gone ({c.file} missing)") from None
            raise KvcliError(f"{self.path} is incomplete: its file {c.file} is missing") from None
        except IsADirectoryError:
            raise KvcliError(f"{f} is corrupted (a directory, not a chunk file)") from None
        except OSError as e:
            raise KvcliError(f"cannot read {f}: {e.strerror}") from None
        if len(state) < c.nbytes:
            raise KvcliError(f"{f} is truncated ({len(state)} bytes, the store recorded {c.nbytes})")
        if len(state) != c.nbytes or hashlib.sha256(state).hexdigest() != c.sha256:
            raise KvcliError(f"{f} is corrupted (its SHA-256 is not the one the store recorded)")
        return state

    def _read_file(self, f: dict) -> bytes:
        """An index or summary file's bytes, checked as a chunk file is."""
        return self._read_chunk(StoredChunk(0, 0, 0, f["file"], f["sha256"], f["nbytes"]))

    def _snapshot(self, c: StoredChunk) -> SeqSnapshot:
        state = self._read_chunk(c)
        if self.chunk_type in CHUNK_TYPES:   # a q8_0 chunk, put back into the float16 cache
            state = convert_chunk(state, F16)
        return SeqSnapshot(state=state, next_pos=c.first_pos + c.n, cells=c.n, prompt_tokens=c.n)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Delete the store folder unless it is kept; its document store entry is released (a temporary one
        removed, a kept one marked used now)."""
        if self.entry is not None:
            self.entry.release()
            self.entry = None
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


# ---------------------------------------------------------------------------------- a read's files and its carry
def _file_record(folder: Path, name: str, data: bytes) -> dict:
    """Write `data` to folder/name (atomically); its record: file, SHA-256, size."""
    outfile.write(folder / name, [data])
    return {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "nbytes": len(data)}


def _snap_fields(snap: SeqSnapshot) -> dict:
    """What a saved sequence needs beside its state to be put back (SeqSnapshot): after a re-indexing compaction
    each (layer, KV head)'s kept positions are its first slot up to next_pos (NativeSession.apply_plan)."""
    kp = snap.kept_positions
    first = None if kp is None else [[int(h[0]) if len(h) else int(snap.next_pos) for h in layer] for layer in kp]
    return {"next_pos": int(snap.next_pos), "cells": int(snap.cells), "prompt_tokens": int(snap.prompt_tokens),
            "reindexed": int(snap.reindexed), "first_slots": first}


def _snapshot_of(rec: dict, state: bytes) -> SeqSnapshot:
    b = rec["next_pos"]
    kp = None if rec.get("first_slots") is None else \
        [[np.arange(f, b, dtype=np.int32) for f in layer] for layer in rec["first_slots"]]
    return SeqSnapshot(state=state, next_pos=b, cells=rec["cells"], prompt_tokens=rec["prompt_tokens"],
                       kept_positions=kp, reindexed=rec["reindexed"])


@dataclass
class _Resumed:
    """What an interrupted read of the same document left (document_store.resume found its entry), every file
    checked: its chunks, their index pages, the cache it carried after the last one, the seconds it read."""
    chunks: list[StoredChunk]
    pages: list[dict]
    carry: dict
    read_s: float

    @classmethod
    def check(cls, entry) -> "_Resumed | None":
        rec, part = entry.record, entry.part
        try:
            chunks = [StoredChunk(**c) for c in rec.get("chunks_done") or []]
            pages, carry = list(rec.get("pages_done") or []), rec.get("carry")
            if not chunks or carry is None or part is None or (pages and len(pages) != len(chunks)):
                return None
            first = 0
            for c in chunks:
                if c.first_token != first or not _CHUNK_FILE.fullmatch(c.file):
                    return None
                first += c.n
            files = [(c.file, c.sha256, c.nbytes) for c in chunks] + \
                [(f["file"], f["sha256"], f["nbytes"]) for f in pages + [carry]]
            for name, sha, nbytes in files:
                data = (part / Path(name).name).read_bytes()
                if len(data) != nbytes or hashlib.sha256(data).hexdigest() != sha:
                    return None
            if bool(pages) != (rec.get("settings", {}).get("index", 0) > 0):
                return None
            return cls(chunks, pages, dict(carry), float(rec.get("read_s") or 0.0))
        except (OSError, TypeError, KeyError, ValueError):
            return None

    def snapshot(self, part: Path) -> SeqSnapshot:
        return _snapshot_of(self.carry, (part / self.carry["file"]).read_bytes())


# ---------------------------------------------------------------------------------- the store folder
class _Named:
    """A manifest seen as kvc's checks see a file (meta, path): kvc.check_versions / check_model."""

    def __init__(self, meta: dict, path: Path):
        self.meta, self.path = meta, path


def is_store(path) -> bool:
    """A folder with a store.json: a bounded store (kvcli run/chat --cache DIR)."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / MANIFEST).exists()


def _digest(m: dict) -> str:
    return hashlib.sha256(json.dumps(m, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                          .encode("utf-8")).hexdigest()


def write_manifest(folder: Path, m: dict) -> int:
    """store.json with its own SHA-256 (over the rest, as canonical JSON), written atomically."""
    m = {k: v for k, v in m.items() if k != "sha256"}
    return outfile.write(folder / MANIFEST, [json.dumps({**m, "sha256": _digest(m)}, ensure_ascii=False)
                                             .encode("utf-8")])


def read_manifest(path) -> dict:
    """store.json of the store folder `path`, refused in one line unless it is whole (its SHA-256), of this store
    format, kvcli version and native state format, and well formed (chunks that tile the stored tokens, file names
    inside the folder)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise KvcliError(f"store folder not found: {path}")
    if not path.is_dir():
        raise KvcliError(f"{path} is not a folder, not a kvcli store")
    f = path / MANIFEST
    if not f.exists():
        raise KvcliError(f"{path} is a folder without {MANIFEST}: not a kvcli store (a .kvc file or a store folder "
                         "written by kvcli chat --store / kvcli compress --store)")
    if not f.is_file():
        raise KvcliError(f"{f} is not a regular file")
    try:
        raw = f.read_bytes()
    except OSError as e:
        raise KvcliError(f"cannot read {f}: {e.strerror}") from None
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise KvcliError(f"{f} is corrupted or truncated (not JSON)") from None
    if not isinstance(m, dict) or "kvcli_store" not in m:
        raise KvcliError(f"{f} is not a kvcli store manifest")
    if m["kvcli_store"] not in READS:
        raise KvcliError(f"{path} is a store of format {m['kvcli_store']}; this kvcli reads formats "
                         f"{', '.join(map(str, READS))}: "
                         "read the document again")
    digest = m.pop("sha256", None)
    if digest != _digest(m):
        raise KvcliError(f"{f} is corrupted (checksum mismatch)")
    kvc.check_versions(_Named(m, path))
    why = _malformed(m)
    if why:
        raise KvcliError(f"{f} is corrupted ({why})")
    return m


def _malformed(m: dict) -> str:
    """What is wrong with a manifest whose checksum holds (written by a kvcli with other rules), or ''."""
    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0
    model = m.get("model")
    if not (isinstance(model, dict) and all(isinstance(model.get(k), str) for k in ("hash", "name", "path"))):
        return "no model it is bound to"
    if not isinstance(m.get("cache_type"), str) or not isinstance(m.get("flash_attn"), bool):
        return "no cache type"
    if m.get("chunk_type", m["cache_type"]) not in (m["cache_type"], "q8_0") or \
            (m.get("chunk_type") == "q8_0" and m["cache_type"] != "f16"):
        return "chunk type"
    tokens = m.get("tokens")
    if not isinstance(tokens, list) or not all(count(t) for t in tokens):
        return "tokens"
    if not (count(m.get("split")) and m["split"] == len(tokens) > 0 and count(m.get("chunk")) and m["chunk"] > 0
            and count(m.get("read_budget")) and isinstance(m.get("read_policy"), str)
            and isinstance(m.get("read_s"), (int, float))):
        return "split, chunk or reading policy"
    meta = m.get("meta")
    if not (isinstance(meta, dict) and isinstance(meta.get("document"), str)
            and (meta.get("system") is None or isinstance(meta.get("system"), str))
            and isinstance(meta.get("turns"), list)):
        return "document"
    keys = {"question": str, "answer": str, "stopped": str, "tokens_in": int, "tokens_out": int}
    if not all(isinstance(t, dict) and set(t) == set(keys) and all(isinstance(t[k], v) for k, v in keys.items())
               for t in meta["turns"]):
        return "turns"
    chunks = m.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        return "no chunks"
    first, names = 0, set()
    fields = {"first_token", "n", "first_pos", "file", "sha256", "nbytes"}
    for i, c in enumerate(chunks):
        if not (isinstance(c, dict) and set(c) == fields and all(count(c[k]) for k in fields - {"file", "sha256"})
                and c["n"] > 0 and isinstance(c["file"], str) and _CHUNK_FILE.fullmatch(c["file"])
                and isinstance(c["sha256"], str) and c["file"] not in names):
            return f"chunk {i}"
        if c["first_token"] != first:
            return f"chunk {i} does not follow chunk {i - 1}"
        first += c["n"]
        names.add(c["file"])
    if first != m["split"]:
        return f"the chunks hold {first} tokens, the store {m['split']}"
    index, summary = m.get("index"), m.get("summary")
    if index is not None:
        files = index.get("files") if isinstance(index, dict) else None
        if not (isinstance(files, list) and len(files) == len(chunks) and count(index.get("page"))
                and index["page"] > 0 and all(_file_ok(f, _INDEX_FILE) for f in files)
                and len({f["file"] for f in files}) == len(files)):
            return "block index"
    if summary is not None:
        fields = {"next_pos", "cells", "prompt_tokens", "reindexed"}
        if not (_file_ok(summary, re.compile(re.escape(SUMMARY))) and all(count(summary.get(k)) for k in fields)
                and (summary.get("first_slots") is None or isinstance(summary["first_slots"], list))):
            return "summary"
    return ""


def _file_ok(f, name: re.Pattern) -> bool:
    return (isinstance(f, dict) and isinstance(f.get("file"), str) and bool(name.fullmatch(f["file"]))
            and isinstance(f.get("sha256"), str) and isinstance(f.get("nbytes"), int) and f["nbytes"] >= 0)


def check_store_target(path, force: bool = True, form: str | None = None) -> Path:
    """Where a store may be written, checked before the document is read (as outfile.check_target checks a file):
    an existing folder is replaced only when it is a store folder (or empty); `form` "bounded" (a folder) refuses an
    existing file, "exact" (a .kvc file) an existing folder; `force` False refuses anything existing."""
    path = Path(path).expanduser()
    outfile.check_names(path, "cannot write")
    if not path.parent.is_dir():
        raise KvcliError(f"cannot write {path}: directory {path.parent} does not exist")
    if path.is_dir():
        if not is_store(path) and any(path.iterdir()):
            raise KvcliError(f"{path} is a folder that is not a kvcli store: kvcli replaces only a store folder "
                             f"(one with {MANIFEST}): name a new path")
        if form == "exact":
            raise KvcliError(f"{path} is a folder, and this document's full cache is stored as one .kvc file (the "
                             "exact form): name a file")
    elif path.exists():
        if form == "bounded":
            raise KvcliError(f"{path} is a file, and this document is stored in bounded chunks, a folder of chunk "
                             "files: name a new path")
    if not force and (path.exists() or path.is_symlink()):
        raise KvcliError(f"{path} exists: pass --force to overwrite it")
    return path


def replace_folder(part: Path, path: Path) -> None:
    """Rename the written folder `part` to `path`; a store folder already there is moved aside first and removed
    after, so that `path` is at every moment the old store or the new one (never a folder that is not a store)."""
    old = None
    if path.is_dir() and not path.is_symlink():
        if not is_store(path) and any(path.iterdir()):
            raise KvcliError(f"{path} is a folder that is not a kvcli store: not replaced")
        old = path.with_name(f"{path.name}.old.{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        path.rename(old)
    elif path.exists() or path.is_symlink():
        raise KvcliError(f"{path} exists and is not a store folder: not replaced")
    part.rename(path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


CHUNK_TYPES = {"q8_0": Q8_0}   # chunk files of another type than the cache they are read in: kvcli/native/state.py


def store_types(cache_type: str) -> tuple[str, str]:
    """(the cache a bounded store is read and re-selected in, its chunk files' rows) for `--cache-type`.

    A quantised cache's kept keys would be re-quantised at every chunk (kvcli/drivers/chunked.py `requantises`), so a
    quantised store is read in float16 and only its chunk files are q8_0, each key quantised once; the cache itself
    stays budget + a chunk either way. Other quantised types are refused: kvcli has no chunk format for them."""
    if requantises(cache_type) is None:
        return cache_type, cache_type
    if cache_type in CHUNK_TYPES:
        return "f16", cache_type
    raise KvcliError(f"a document stored in bounded chunks holds float16 or q8_0 rows, not {cache_type}: bounded "
                     "reading re-indexes its kept keys at every chunk, which re-quantises a quantised cache's keys "
                     "each time (use --cache-type q8_0 or f16)")


def check_usable(session, cfg: Compression, spare: int | None = None) -> None:
    """Bounded re-selection's conditions, each refused in one line (`spare`: the sequence chunks are loaded
    through must exist)."""
    if not shares_cells(session):
        raise KvcliError("bounded re-selection needs the native engine (it moves stored cells between sequences)")
    if keeps_positions(session.info):
        raise KvcliError(f"a model with sliding-window layers ({session.info.architecture}) is read without "
                         "re-indexing: it gets exact re-selection only (the document must fit its context)")
    kinds = set(cfg.observe[0])
    if "colsum" in kinds or "colmax" in kinds:
        what = "column sums" if "colsum" in kinds else "column maxima of its reconstruction pass"
        raise KvcliError(f"policy '{cfg.policy}' scores by the {what} of every query, which bounded "
                         "re-selection does not replay: choose a window policy (snapkv, pyramidkv, ...)")
    if kinds - {"window", "kv"}:
        raise KvcliError(f"policy '{cfg.policy}' observes {', '.join(sorted(kinds))}: bounded re-selection serves "
                         "window policies only")
    if cfg.budget is None:
        raise KvcliError(f"bounded re-selection compresses: policy '{cfg.policy}' needs --budget N")
    if spare is not None and not 0 <= spare < session.n_seq:
        raise KvcliError(f"bounded re-selection loads chunks through a second sequence: the context holds "
                         f"{session.n_seq}")
