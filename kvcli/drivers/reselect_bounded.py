"""Bounded re-selection: a document whose full cache should not be held at once, stored chunk by chunk as bounded
reading reads it, and re-selected for every question by streaming the stored chunks.

Exact re-selection (kvcli/drivers/reselect.py) restores the document's whole full cache for every question: its
peak is the full cache. Here the cache never holds more than the entries kept so far + one chunk (+ a probe):

    reading (once): bounded reading (kvcli/drivers/chunked.py, each chunk scored by its own last window, no
        question being known) with every chunk's entries saved to the store after its prefill, before the
        compaction: the store is written chunk by chunk and never costs the full cache in RAM.
    per question: the stored chunks are put back one after the other beside the entries kept so far (moved to
        the positions that follow them: llama.cpp's K-shift), each scored by the question's last `window` tokens
        prefilled as a probe and rolled back (FINCH, as bounded reading scores its chunks), planned to the budget
        and compacted with re-indexing; then the rest of the prompt (the document's last tokens, the conversation,
        the question) is prefilled with the observation armed, planned and compacted like any last chunk.

What the stored entries are: each chunk's K/V as bounded reading computed them, attending to the entries kept when
the document was read (chosen without the question), not to the whole document. So a re-selection here is
question-aware in what it keeps, while the entries it keeps carry the reading's approximation; docs/results.md
("Bounded re-selection") measures what that costs against exact re-selection. Models with sliding-window layers
are read without re-indexing and get exact re-selection only; column-sum policies (h2o, d2o) are refused: their
scores sum every query, and the chunks' own queries are not replayed.

The store is a folder: one file per chunk (an uncompressed cache state of the chunk's cells, kvcli/native/state.py)
and `store.json` (model, tokens, chunks and each file's SHA-256), written to a `.part` folder and renamed when the
reading is done; a file that is gone, truncated or changed is refused in one line.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcli import kvc, outfile
from kvcli.config import env_bytes
from kvcli.drivers.chunked import keeps_positions, probe_window, read_in_chunks
from kvcli.drivers.reselect import STORE_TAIL, Reselection, StoreMissing, common_prefix, store_dir
from kvcli.errors import KvcliError
from kvcli.native.cache import KvReader
from kvcli.native.session import SeqSnapshot
from kvcli.native.state import cells_from
from kvcli.planning.planner import Compression, make_plan, session_cells, shape_observation

FORMAT = 1
# A re-selected chat keeps the exact form (the document's full cache held while a question is re-selected) up to
# this many bytes of full cache, though bounded reading would read the document in chunks: a bounded re-selection
# streams every chunk with a probe, about 1.5x the seconds of an exact one per question (8k, measured on a loaded
# machine: docs/results.md,
# "Bounded re-selection"), and a full cache this size is a moderate addition to the process. Above it, past the
# model's context, or with --chunk N / --max-cache, the bounded form. KVCLI_RESELECT_EXACT_MB moves it.
EXACT_BELOW_BYTES = 256 << 20


def exact_below_bytes() -> int:
    return env_bytes("KVCLI_RESELECT_EXACT_MB", EXACT_BELOW_BYTES)


@dataclass
class BoundedReselection(Reselection):
    """A bounded re-selection: restore_s counts putting the stored chunks back, prefill_s their probes and the rest."""
    chunks: int = 0

    def as_stats(self) -> dict:
        return {**super().as_stats(), "reselect_chunks": self.chunks}


@dataclass
class StoredChunk:
    first_token: int        # its first token in the stored tokens
    n: int                  # tokens (= cells) in it
    first_pos: int          # the position its first entry had when it was read
    file: str               # its state file in the store folder
    sha256: str
    nbytes: int


@dataclass
class ChunkedStore:
    """A document's entries stored chunk by chunk (see the module doc). Same use as reselect.StoredDocument:
    read once, `reselect` per question, `close`."""
    tokens: list[int]
    split: int
    chunk: int
    chunks: list[StoredChunk]
    path: Path                       # the store folder
    keep: bool = False
    read_s: float = 0.0
    cap: int = 0                     # most cells a question's re-selection holds (kept + a chunk + its probe)
    read_policy: str = ""            # the policy and budget the document was read with
    read_budget: int = 0
    meta: dict = field(default_factory=dict)
    colsum = None                    # never stored: column-sum policies are refused
    extension = None                 # the conversation's turns are not stored: each question prefills them again
    bounded = True

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    # ------------------------------------------------------------------ reading once
    @classmethod
    def read(cls, session, tokens: list[int], cfg: Compression, chunk: int, *, cap: int | None = None,
             split: int | None = None, seq: int = 0, spare: int | None = None, path=None, keep: bool = False,
             progress=None, meta: dict | None = None) -> "ChunkedStore":
        """Read tokens[:split] into `seq` by bounded reading with `cfg` and chunks of `chunk` tokens, storing every
        chunk's entries; the sequence is cleared afterwards. `spare`: a second sequence of the context, used per
        question to load a chunk through (append_saved)."""
        spare = seq + 1 if spare is None else spare
        check_usable(session, cfg, spare)
        cap = cap or cfg.budget + chunk
        split = max(1, len(tokens) - STORE_TAIL) if split is None else int(split)
        if not 0 < split <= len(tokens):
            raise KvcliError(f"cannot store {split} of {len(tokens)} tokens")
        if path is None:
            digest = hashlib.sha256(np.asarray(tokens[:split], np.int32).tobytes()).hexdigest()[:12]
            path = store_dir() / f"{Path(session.model_path).stem}.{digest}.{os.getpid()}.chunks"
        path = Path(path)
        part = path.with_name(path.name + ".part")
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        chunks: list[StoredChunk] = []
        done = False

        def save(first_pos: int, n: int) -> None:
            state, cells, end = cells_from(session.save_seq(seq).state, first_pos)
            if cells != n or end != first_pos + n:
                raise KvcliError(f"chunk {len(chunks)}: {cells} cells up to position {end} saved, {n} read")
            name = f"chunk-{len(chunks):04d}.state"
            outfile.write(part / name, [state])
            first_token = chunks[-1].first_token + chunks[-1].n if chunks else 0
            chunks.append(StoredChunk(first_token, n, first_pos, name, hashlib.sha256(state).hexdigest(), len(state)))

        try:
            if seq in session.seqs:
                session.clear(seq)
            # each question's probe (its last `window` tokens) will be held beside a chunk: the chunks leave it room
            room = cfg.observe[1] if "window" in cfg.observe[0] else 0
            t0 = time.perf_counter()
            read_in_chunks(session, list(tokens[:split]), cfg, chunk - room, cap=cap - room,
                           seq=seq, progress=progress, scoring="chunk", on_prefilled=save)
            read_s = time.perf_counter() - t0
            session.clear(seq)
            store = cls(tokens=list(tokens[:split]), split=split, chunk=chunk, chunks=chunks, path=path, keep=keep,
                        read_s=read_s, cap=cap, read_policy=cfg.policy, read_budget=cfg.budget,
                        meta=dict(meta or {}))
            outfile.write(part / "store.json", [json.dumps(store.manifest(session)).encode()])
            shutil.rmtree(path, ignore_errors=True)
            part.rename(path)
            done = True
            return store
        finally:
            if not done:
                shutil.rmtree(part, ignore_errors=True)

    def manifest(self, session) -> dict:
        return {"kvcli_store": FORMAT, **kvc.base_meta(session), "split": self.split, "chunk": self.chunk,
                "read_policy": self.read_policy, "read_budget": self.read_budget, "read_s": round(self.read_s, 3),
                "tokens": [int(t) for t in self.tokens], "meta": self.meta,
                "chunks": [vars(c) for c in self.chunks]}

    # ------------------------------------------------------------------ per question
    def reselect(self, session, prompt: list[int], cfg: Compression, *, seq: int = 0, spare: int | None = None,
                 progress=None, on_step=None, extend: bool = False) -> Reselection:
        """Stream the stored chunks into `seq` beside the entries kept so far, each scored by the prompt's last
        window and compacted to the budget, then prefill the rest of `prompt` with the observation armed, plan
        and compact: `seq` then holds `prompt` compressed for its question, ready to decode. `on_step(obs, plan)`
        is called before each plan is applied. `spare`: the sequence chunks are loaded through (default seq + 1).
        `extend` (keep the prompt's full cache for the next question, as exact re-selection may) does not apply:
        a bounded store holds the document only, and the conversation is prefilled with every question."""
        spare = seq + 1 if spare is None else spare
        check_usable(session, cfg, spare)
        n = len(prompt)
        if common_prefix(self.tokens, prompt) < self.split:
            raise KvcliError("the prompt does not start with the stored document's tokens")
        kinds, window = cfg.observe
        # the question's window must lie in what is prefilled now: the last chunk gives back what it lacks
        cut = max(0, window - (n - self.split)) if "window" in kinds else 0
        if self.chunks and cut > self.chunks[-1].n:
            raise KvcliError(f"the policy's window ({window}) reaches past the stored document's last chunk")
        probe = list(prompt[-window:]) if "window" in kinds else []
        restore_s = prefill_s = plan_s = 0.0
        plan = None
        if seq in session.seqs:
            session.clear(seq)
        for i, c in enumerate(self.chunks):
            t0 = time.perf_counter()
            session.append_saved(self._snapshot(c), seq, spare, filler=int(prompt[-1]))
            last = i == len(self.chunks) - 1
            if last and cut:
                session.truncate(seq, session.seq(seq).next_pos - cut)
            t1 = time.perf_counter()
            restore_s += t1 - t0
            cells = session_cells(session, seq)
            if last or not cfg.spec.compresses(cells, cfg.budget):
                continue
            obs = probe_window(session, seq, probe, None) if probe else shape_observation(session.info, cells)
            if "kv" in kinds:   # the held entries' K/V rows, read by the planner when it asks (spindlekv)
                obs.kv_reader = KvReader(session.ctx, seq, session.info, obs.positions)
            t2 = time.perf_counter()
            prefill_s += t2 - t1
            plan = self._compact(session, seq, cfg, obs, on_step)
            plan_s += time.perf_counter() - t2
        t1 = time.perf_counter()
        rest = list(prompt[self.split - cut:])
        obs = session.prefill(rest, seq=seq, observe=kinds, window=window, progress=progress)
        t2 = time.perf_counter()
        prefill_s += t2 - t1
        cells = session_cells(session, seq)
        if cfg.spec.compresses(cells, cfg.budget):
            plan = self._compact(session, seq, cfg, obs if obs is not None else shape_observation(session.info, cells),
                                 on_step)
        plan_s += time.perf_counter() - t2
        return BoundedReselection(restored=self.split - cut, prefilled=len(rest), n_tokens=n, restore_s=restore_s,
                                  prefill_s=prefill_s, plan_s=plan_s, plan=plan, chunks=len(self.chunks))

    @staticmethod
    def _compact(session, seq, cfg: Compression, obs, on_step):
        plan = make_plan(cfg.spec, cfg.params, cfg.budget, obs, session.engine)
        if on_step is not None:
            on_step(obs, plan)
        session.apply_plan(plan, seq=seq, reindex=True)
        return plan

    def _snapshot(self, c: StoredChunk) -> SeqSnapshot:
        f = self.path / c.file
        try:
            state = f.read_bytes()
        except FileNotFoundError:
            raise StoreMissing(f"the stored document cache {self.path} is gone ({c.file} missing)") from None
        if hashlib.sha256(state).hexdigest() != c.sha256:
            raise KvcliError(f"{f} is corrupted (its SHA-256 is not the one the store recorded)")
        return SeqSnapshot(state=state, next_pos=c.first_pos + c.n, cells=c.n, prompt_tokens=c.n)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Delete the store folder unless it is kept."""
        if not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)


def check_usable(session, cfg: Compression, spare: int | None = None) -> None:
    """Bounded re-selection's conditions, each refused in one line (`spare`: the sequence chunks are loaded
    through must exist)."""
    if session.engine != "native":
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
