"""Re-selection: a document's full cache read once, stored, and compressed again for every question.

A cache compressed before the questions are known keeps what a generic instruction attends to, and loses what
later questions need (docs/results/chat-and-reselection.md, "Many questions over one document"). Re-selection keeps the
document's
full cache where memory is cheap (a file, `StoredDocument`) and, for each question:

    restore the stored entries (positions 0..r-1)  ->  prefill the rest of the prompt (the document's last
    tokens, the conversation, the new question) with observation armed  ->  plan with the policy  ->  compact

so every answer is given from a cache compressed for its own question, as `kvcli run` compresses for its one
question, at the cost of a short prefill over the full cache instead of a new read of the document.

What is stored: the cache of the prompt's first `split` tokens (the chat template's head and the document, less
its last STORE_TAIL tokens), and, for a column-sum policy (observing colsum), the attention column sums of those
`split` queries. The observation of a re-selection is then what one prefill of the whole prompt observes:
- window sums: the last `window` queries all lie in the prefilled rest (the restored part is cut back where the
  window reaches into it, `restore_point`), and they attend to every restored key as they would have;
- column sums: the stored sums of the first `split` queries plus those of the prefilled rest (queries are
  causal: the stored ones never saw what follows them), so a column-sum policy must restore exactly `split`;
- Q rows (the query kind): its last `window` queries lie in the prefilled rest, as window sums do;
- K/V rows: read from the cache as restored.
(tests/test_reselect.py checks both engines against `run`'s single prefill: L2 for the observation, L1 for the plan.)

A conversation's turns (`extend=True`, kvcli chat): after the prefill and before the compaction, the sequence holds
the exact full cache of the whole prompt (the document, the earlier turns, the new question). It is kept beside the
stored document as its `extension` (in memory: see `Extension`), with the column sums of all its queries when they
were observed (the stored ones + the prefilled rest's; a stored query's sums over later keys are zero by causality).
The next question's prompt starts with it (the same turns and question, then the answer and the new question), so
it restores the extension and prefills only what is new: the answer (generated over the compressed cache, so not in
the full cache) and the new question, or the policy's window if that is longer. Whichever of the two it restores
from, `common_prefix` with the prompt bounds what is restored, so the observation stays one prefill's: a prompt the
template renders otherwise (an interrupted turn dropped, /reset) restores from the document, as does a column-sum
policy whose window would reach into the extension or that lacks its sums.

The stored file is a `.kvc` file of the full cache with a "store" section (kvcli/kvc.py): model-bound,
checksummed, written atomically; `kvcli compress --store` writes one, and `kvcli run/chat --cache FILE --policy P
--budget N` re-select from it. A plain `kvcli compress --policy full` file re-selects too (no column sums: window
policies only).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcli import document_store, engines, kvc
from kvcli.errors import KvcliError
from kvcli.planning.planner import Compression, make_plan, shape_observation
from kvcli.session import Session

# document tokens left out of the store and re-read with every question: the tokenizer may merge the document's
# last tokens with what follows it ("\n\n" + the question). A policy whose window reaches further back has the
# restored entries cut back to make room for it (`restore_point`).
STORE_TAIL = 8

# window_from="question" (kvcli serve, kvcli chat): a window policy's window is the tokens after what the prompt shares
# with the stored document (the question, with its turn's template), at most the policy's window and at least this:
# a question then prefills only its own tokens over the document, as llama-server's cache_prompt does
QUESTION_WINDOW_MIN = 8
WINDOW_MODES = ("question", "policy")


def common_prefix(a, b) -> int:
    n = min(len(a), len(b))
    x, y = np.asarray(a[:n]), np.asarray(b[:n])
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


@dataclass
class Reselection:
    """What one re-selection did and cost (seconds)."""
    restored: int            # stored entries put back (positions 0..restored-1)
    prefilled: int           # prompt tokens prefilled with observation after them
    n_tokens: int            # the whole prompt
    restore_s: float
    prefill_s: float
    plan_s: float            # planning + compaction
    plan: object = None
    source: str = "document"   # restored from the stored "document" or from the "conversation" (its extension)
    resident: bool = False   # restored by sharing the resident cells where they lie (StoredDocument.resident)
    seq: int = 0             # the sequence that holds the re-selected cache (a resident document's: `into`)
    dropped_seq: int | None = None   # a resident extension's old sequence, replaced by this one: the caller frees it
    keep_s: float = 0.0      # extend=True: keeping the prompt's full cache as the extension (save_seq)
    reconstruct_s: float | None = None   # the policy's second pass, if it has one (part of prefill_s)
    window: int | None = None   # the observation window the plan was scored by (window="question" may cut it)

    @property
    def total_s(self) -> float:
        return self.restore_s + self.prefill_s + self.plan_s + self.keep_s

    def as_stats(self) -> dict:
        return {"reselect_s": round(self.total_s, 4), "reselect_restore_s": round(self.restore_s, 4),
                "reselect_prefill_s": round(self.prefill_s, 4), "reselect_plan_s": round(self.plan_s, 4),
                "reselect_keep_s": round(self.keep_s, 4), "reselect_from": self.source, "reselect_window": self.window,
                "reselect_resident": self.resident,
                "reselect_restored_tokens": self.restored, "reselect_prefilled_tokens": self.prefilled,
                **({} if self.reconstruct_s is None else {"reconstruct_s": round(self.reconstruct_s, 4)})}


@dataclass
class Extension:
    """The exact full cache of a whole prompt (the stored document, then a conversation's turns and question), kept
    by a re-selection before it compacted (StoredDocument.reselect(extend=True)), for the next question to restore.

    Kept in memory (`snapshot`, the sequence's saved state), not written to the document's file: the next question
    restores it without reading and checking a file, no question writes one (tens to hundreds of MB, fsynced), the
    file stays the document's store that any other question or chat can start from, and a full or vanished disk
    does not touch it. It costs one state of the prompt's size in memory beside the KV buffer (94 MB at 8k tokens on
    qwen2.5-coder-0.5b), which only one of is held at a time (the old one is dropped before the new one is saved)."""
    tokens: list[int]
    snapshot: object
    colsum: np.ndarray | None = None   # [n_layer, n_head, len(tokens)]: every query's column sums, or None
    nbytes: int = 0
    seq: int | None = None   # a resident document's: the sequence still holding the prompt (its shared cells and
                             # its own), instead of a snapshot; its owner frees it (kvcli/drivers/resident.py)

    @property
    def split(self) -> int:
        return len(self.tokens)

    def describe(self, n_tokens: int) -> str:
        """Where the conversation's turns (`n_tokens` after the document) are kept, in words (a chat's /stats)."""
        if self.seq is not None:
            return (f"the conversation's turns kept in the context beside the document: {n_tokens} tokens "
                    f"({self.nbytes / 1e6:.2f} MB)")
        return (f"the conversation's full cache kept in memory: {n_tokens} tokens after the document "
                f"({self.nbytes / 1e6:.2f} MB with it)")


@dataclass
class StoredDocument:
    """The full cache of a prompt's first `split` tokens, kept in a file (native engine) or in memory.

    `tokens`: the stored tokens (the prompt's common prefix); `colsum`: [n_layer, n_head, split] attention column
    sums of those queries, or None when none were observed; `path`: the file; `keep`: leave it at close()."""
    tokens: list[int]
    split: int
    colsum: np.ndarray | None = None
    path: Path | None = None
    snapshot: object = None          # in memory instead of a file (the reference engine)
    nbytes: int = 0                  # bytes of the stored cache state
    read_s: float = 0.0              # the one prefill of the document
    keep: bool = True
    meta: dict = field(default_factory=dict)   # what the file's .kvc header carries besides (document, system)
    form = "exact"                   # its name in stats and store records (ChunkedStore: "bounded")
    can_be_resident = True           # its full cache can be held in the context, shared by every question
    tag = ""                         # after "re-selected per question" in a chat's summary line
    extension: Extension | None = None         # the last re-selected prompt's full cache (extend=True)
    entry: object = None             # its kvcli.document_store.Entry, held while this process uses the file
    resident: int | None = None      # the session's sequence holding the full cache now (`make_resident`)
    session: object = field(default=None, repr=False, compare=False)   # whose context holds it (close() frees it)

    # ------------------------------------------------------------------ reading once
    @classmethod
    def read(cls, session: Session, tokens: list[int], *, split: int | None = None, seq: int = 0,
             colsum: bool = False, path=None, keep: bool = False, progress=None, meta: dict | None = None,
             in_memory_if_unwritable=None, key: str | None = None, resident: bool = False) -> "StoredDocument":
        """Prefill tokens[:split] into `seq` (observing their column sums with `colsum`) and store the cache:
        to `path` (a .kvc file; None: a temporary entry of the document store, kvcli/document_store.py) for the
        native engine, in memory for the reference one. `split` defaults to len(tokens) - STORE_TAIL. The sequence is
        cleared afterwards.
        A file that cannot be written (disk full) is an error, unless `in_memory_if_unwritable` is given: it is
        called with the one-line reason and the cache is kept in memory instead. `key` (no `path`): the store stays
        in the document store after close() as a `cached` entry of that key, for `document_store.find(key)`.
        `resident` (native engine): `seq` keeps the cache, which the file is written from (`make_resident`); no copy
        of it stays in memory."""
        split = max(1, len(tokens) - STORE_TAIL) if split is None else int(split)
        if not 0 < split <= len(tokens):
            raise KvcliError(f"cannot store {split} of {len(tokens)} tokens")
        # the native engine's store is a file: an entry of the document store (kvcli/document_store.py) from now
        # on, so that whatever ends this process, the file is listed or removed by the next kvcli
        entry = None if not engines.saves_state(session) else document_store.create(
            form="exact", model_path=session.model_path, tokens=tokens[:split], kept_path=path, key=key,
            settings={"split": split, "colsum": bool(colsum), "cache_type": session.cache_type},
            reserve=0 if keep else split * session.bytes_per_cell())
        try:
            t0 = time.perf_counter()
            if seq in session.seqs:
                session.clear(seq)
            obs = session.prefill(list(tokens[:split]), seq=seq, observe=("colsum",) if colsum else (),
                                  progress=progress)
            read_s = time.perf_counter() - t0
            sums = None if obs is None or obs.colsum is None else np.ascontiguousarray(obs.colsum[:, :, :split],
                                                                                       np.float32)
            store = cls(tokens=list(tokens[:split]), split=split, colsum=sums, read_s=read_s, keep=keep,
                        meta=dict(meta or {}))
            if entry is None:   # the reference engine: in memory
                store.snapshot, store.path = session.save_seq(seq), None
                session.clear(seq)
                return store
            store.nbytes = split * session.bytes_per_cell()
            store.path = Path(path) if path is not None else entry.payload
            try:   # streamed from the context in pieces: no whole copy of the cache in memory
                store.write_from(session, seq, store.path)
            except KvcliError as e:
                if in_memory_if_unwritable is None:
                    raise
                in_memory_if_unwritable(f"{e}: the document's full cache is kept in memory instead")
                store.path = None
                if not resident:
                    store.snapshot = session.save_seq(seq)
                entry.abandon()
                entry = None
            if resident:
                store.resident, store.session = seq, session
            else:
                session.clear(seq)
            if entry is None:
                return store
        except BaseException:
            if entry is not None:
                entry.abandon()
            if resident:
                session.clear(seq)
            raise
        cached = key is not None and path is None   # stays in the document store after close()
        entry.finish("kept" if keep else "cached" if cached else "temporary")
        store.entry, store.keep = entry, keep or cached
        return store

    def write_from(self, session, seq: int, path, turns: list | None = None) -> int:
        """Write the store to `path` (a format-3 .kvc file) streamed from `seq`, which holds its full cache: a piece
        of cells at a time (NativeSession.save_seq_pieces), never the whole state in memory. Returns the size."""
        if turns is not None:
            self.meta["turns"] = list(turns)
        if not any(q != seq and not session.seq(q).cells for q in range(session.n_seq)):
            # a context of one sequence has none to pass the pieces through: the state whole (a copy in memory)
            return kvc.write(path, self.to_kvc(session, session.save_seq(seq).state))
        f = self.to_kvc(session, b"")
        return kvc.write_pieces(path, f.meta, f.prefix_tokens, self.colsum,
                                session.save_seq_pieces(seq, session.free_seq(seq)))

    def to_kvc(self, session, state: bytes) -> kvc.KvcFile:
        m = self.meta
        meta = kvc.base_meta(session)
        meta.update({"policy": "full", "budget": None, "policy_args": {}, "resolved_params": None,
                     "original_tokens": len(self.tokens), "mode": "question-agnostic", "question": None,
                     "system": m.get("system"), "document": m.get("document", ""), "generic_suffix": None,
                     "compressed": False,
                     "conversation": {"reset_pos": self.split, "reset_cells": self.split, "next_pos": self.split,
                                      "cells": self.split, "reindexed": 0, "rope": session.rope_regime,
                                      "tail": "user", "pending": False, "turns": list(m.get("turns", []))},
                     "store": {"split": self.split, "n_head": session.info.n_head,
                               "colsum": self.colsum is not None}})
        return kvc.KvcFile(meta=meta, prefix_tokens=np.asarray(self.tokens, np.int32), state=state,
                           colsum=self.colsum)

    @classmethod
    def from_file(cls, path, session) -> "StoredDocument":
        """A stored document (or any uncompressed .kvc file: its cells are the stored tokens) for `session`'s
        model; refused in one line when it is compressed, corrupt, truncated or another model's."""
        return cls.from_kvc(kvc.load_checked(path, session.model_path))

    @classmethod
    def from_kvc(cls, f: kvc.KvcFile) -> "StoredDocument":
        """`from_file` of a .kvc file read and checked already (kvc.load_checked's checks)."""
        path = f.path
        if f.meta["compressed"] or f.meta["conversation"]["cells"] != f.meta["conversation"]["next_pos"]:
            raise KvcliError(f"{path} holds a compressed cache: re-selection needs a document's full cache "
                             "(kvcli compress --store)")
        st = f.meta.get("store") or {}
        n = int(f.meta["conversation"]["next_pos"])
        if len(f.prefix_tokens) < n:
            raise KvcliError(f"{path} is corrupted (fewer prompt tokens than stored cells)")
        return cls(tokens=[int(t) for t in f.prefix_tokens[:n]], split=n, colsum=f.colsum, path=Path(path),
                   nbytes=f.state_nbytes, keep=True,
                   meta={"document": f.meta["document"], "system": f.meta.get("system"),
                         "turns": f.meta["conversation"].get("turns", []), "store": bool(st)},
                   entry=document_store.use_path(path) if path is not None else None)   # listed: in use, used now

    # ------------------------------------------------------------------ per question
    def restore_point(self, n_prompt: int, cfg: Compression, split: int | None = None) -> int:
        """How many stored entries (of `split`: the document's, or the extension's) to put back for a prompt of
        n_prompt tokens: all, or fewer when the policy's window reaches into them (a column-sum policy cannot be cut
        back: its sums are split's)."""
        kinds, window = cfg.observe
        r = self.split if split is None else split
        # a query-observing policy's statistics are its last `window` queries' (Q rows): prefilled, like a window's
        if ("window" in kinds or "query" in kinds) and n_prompt - r < window:
            if "colsum" in kinds:
                raise KvcliError(f"the policy's window ({window}) reaches into the stored document, whose column "
                                 f"sums cover its first {r} tokens: lower window=")
            r = max(0, n_prompt - window)
        return r

    def question_window(self, prompt: list[int], cfg: Compression, session: Session | None = None) -> Compression:
        """`cfg` with its observation window cut to the tokens of `prompt` from the start of the line where it
        departs from the stored document (or the kept conversation), when those are fewer: the question's own
        tokens score the document, and no stored entry before its line is prefilled again (`session`: the
        tokenizer that finds the line; without it, from the first token not shared). Column-sum policies (their
        sums are the split's) and query-row statistics (many queries, not a question) are
        left as they are."""
        kinds, window = cfg.observe
        if "window" not in kinds or "colsum" in kinds or not cfg.spec.window_param or not cfg.compresses(len(prompt)):
            return cfg
        n = len(prompt)
        shared = min(common_prefix(self.tokens, prompt), self.split)
        if self.extension is not None:   # a conversation's next turn: the new turn is the question (a prompt asked
            ext = min(common_prefix(self.extension.tokens, prompt), self.extension.split)   # again is scored as
            if n - ext >= QUESTION_WINDOW_MIN:                                                # it was the first time)
                shared = max(shared, ext)
        if session is not None and shared < n and b"\n" not in session.token_bytes(prompt[shared]):
            # back to the line's start: a question's first words may be stored already (another question about
            # the document began with them); no line break within the window: from the first token not shared
            start = shared
            while start > max(0, shared - window) and b"\n" not in session.token_bytes(prompt[start - 1]):
                start -= 1
            if start > 0 and b"\n" in session.token_bytes(prompt[start - 1]):
                shared = start
        w = min(window, max(n - shared, QUESTION_WINDOW_MIN))
        if w >= window:
            return cfg
        return Compression(cfg.policy, cfg.budget, cfg.spec, {**cfg.params, cfg.spec.window_param: w})

    def _extension_for(self, prompt: list[int], cfg: Compression) -> tuple[Extension | None, int]:
        """The extension and how many of its entries to restore, when restoring it puts back more of `prompt`
        than the document does, exactly; else (None, 0)."""
        ext = self.extension
        if ext is None:
            return None, 0
        n, kinds = len(prompt), cfg.observe[0]
        same = common_prefix(ext.tokens, prompt)
        if "colsum" in kinds:   # its sums cover all its queries: usable whole or not at all
            if ext.colsum is None or same < ext.split or ("window" in kinds and n - ext.split < cfg.observe[1]):
                return None, 0
            r = ext.split
        else:
            r = min(self.restore_point(n, cfg, ext.split), same)
        try:
            base = min(self.restore_point(n, cfg), common_prefix(self.tokens, prompt))
        except KvcliError:
            base = -1
        return (ext, r) if base < r < n else (None, 0)

    def restore(self, session: Session, seq: int, upto: int, extension: Extension | None = None) -> None:
        """Put the stored entries (or the extension's) of positions 0..upto-1 back into `seq` (its previous cells
        are dropped). A resident document's are shared, not copied (`make_resident`), and so are the cells of an
        extension kept as a sequence."""
        source = self.resident if extension is None else extension.seq
        if source is not None:
            session.clear(seq)
            session.share(source, seq, upto)
            return
        if extension is not None:
            snap = extension.snapshot
            if engines.saved_state(snap) is not None:   # native: the saved state puts back its cells as they were
                snap = engines.SeqSnapshot(state=snap.state, next_pos=snap.next_pos, cells=snap.cells,
                                           prompt_tokens=snap.prompt_tokens, rope=snap.rope)
            session.restore_seq(snap, seq)
            if upto < extension.split:
                session.truncate(seq, upto)
            return
        if self.snapshot is not None:
            snap = self.snapshot
        else:
            if self.path is None or not self.path.exists():
                raise StoreMissing(f"the stored document cache {self.path} is gone")
            f = kvc.read(self.path)
            if f.state is None and session.n_seq == 1:   # no sequence to pass pieces through: put back whole
                snap = file_snapshot(f, b"".join(kvc.iter_state_pieces(f)))
            elif f.state is None:   # format 3: put back a piece at a time (NativeSession.restore_seq_pieces)
                c = f.meta["conversation"]
                session.clear(seq)
                session.restore_seq_pieces(kvc.iter_state_pieces(f), seq, session.free_seq(seq),
                                           next_pos=int(c["next_pos"]), cells=int(c["cells"]), rope=c.get("rope"))
                if upto < self.split:
                    session.truncate(seq, upto)
                return
            else:
                snap = file_snapshot(f)
            del f
        session.restore_seq(snap, seq)
        if upto < self.split:
            session.truncate(seq, upto)

    # ------------------------------------------------------------------ resident in the context
    def make_resident(self, session: Session, seq: int) -> None:
        """Hold the full cache in `seq` of the session from now on (restored once from the file or the snapshot):
        every question shares its cells (`restore`) and gathers its selection beside them (`reselect(into=...)`).
        While it is resident its in-memory snapshot is dropped: the cache is held once, in the context (`evict`
        takes a snapshot again where no file holds it)."""
        if self.resident == seq:
            return
        self.restore(session, seq, self.split)
        self.resident, self.session = seq, session
        self.snapshot = None

    def drop_extension(self, session: Session) -> None:
        """Forget the extension; one kept as a sequence (a resident document's) frees it."""
        ext, self.extension = self.extension, None
        if ext is not None and ext.seq is not None and session.ctx is not None:
            session.clear(ext.seq)

    def evict(self, session: Session) -> None:
        """Free the resident sequence; a document without a file keeps its cache as a snapshot in memory first."""
        if self.resident is None:
            return
        self.drop_extension(session)
        if self.snapshot is None and (self.path is None or not self.path.exists()):
            self.snapshot = session.save_seq(self.resident)
        session.clear(self.resident)
        self.resident = self.session = None

    def reselect(self, session: Session, prompt: list[int], cfg: Compression, *, seq: int = 0,
                 progress=None, on_step=None, extend: bool = False, into: int | None = None,
                 window_from: str = "policy") -> Reselection:
        """Restore, prefill the rest of `prompt` with the observation `cfg` needs, plan and compact: `seq` then
        holds `prompt` compressed for its own last tokens (the question), ready to decode. `on_step(obs, plan)`
        is called before the plan is applied (tests compare the observation with `run`'s).

        Restores from the extension when it puts back more of `prompt` exactly (`_extension_for`), else from the
        stored document. `extend`: keep the prompt's full cache, as it is before the compaction, as the new
        extension (a conversation, whose next prompt starts with this one).

        A resident document (`make_resident`) is shared into `seq` instead of restored, and with `into` the plan is
        gathered into that empty sequence instead of compacting `seq`: the document's cells never move and no copy
        of them is made (`Reselection.seq` says which sequence to decode; the caller clears `into` after the answer,
        and `seq`, the question's cells, unless `extend` kept it as the extension: then `seq` itself is the
        extension, sharing the document's cells, and the old extension's sequence is the caller's to free,
        `Reselection.dropped_seq`).

        `window_from`: "policy" (the policy's window: its stored entries are cut back to prefill it whole) or "question"
        (`question_window`)."""
        n = len(prompt)
        if window_from == "question":
            cfg = self.question_window(prompt, cfg, session)
        resident = self.resident is not None
        ext, r = self._extension_for(prompt, cfg)
        if ext is None:
            same = common_prefix(self.tokens, prompt)
            if same < self.split and "colsum" in cfg.observe[0]:
                raise KvcliError("the prompt does not start with the stored document's tokens")
            r = min(self.restore_point(n, cfg), same)
            if r >= n:
                raise KvcliError("the prompt ends inside the stored document: nothing to ask")
            if "colsum" in cfg.observe[0] and self.colsum is None:
                raise NoColsum(f"policy '{cfg.policy}' scores by column sums, which the stored document lacks")
        sums = self.colsum if ext is None else ext.colsum
        source = "document" if ext is None else "conversation"
        t0 = time.perf_counter()
        try:
            self.restore(session, seq, r, ext)
        except KvcliError:
            if ext is None:
                raise
            # the kept turns cannot be put back here (e.g. a sliding-window cache that no longer reaches back to
            # the restore point): the stored document can, exactly
            self.drop_extension(session)
            return self.reselect(session, prompt, cfg, seq=seq, progress=progress, on_step=on_step, extend=extend,
                                 into=into, window_from=window_from)
        ext = None   # no reference left to the old extension's state once `extend` drops it: one held at a time
        t1 = time.perf_counter()
        compresses = cfg.compresses(n)
        kinds, window = cfg.observe if compresses else ((), 0)
        extra = cfg.spec.second_pass if compresses else None
        obs = session.prefill(list(prompt[r:]), seq=seq, observe=tuple(k for k in kinds if extra is None
                                                                        or k != extra.kind),
                              window=window, progress=progress)
        recon_s = None
        if extra is not None:   # the policy's second pass over the whole prompt (PolicySpec.second_pass)
            obs = obs if obs is not None else shape_observation(session.info, n)
            got = extra.run(session, list(prompt), seq, cfg.params)
            setattr(obs, extra.kind, got.scores)
            recon_s = got.seconds
        t2 = time.perf_counter()
        if obs is not None and obs.colsum is not None:   # the stored queries' sums + the rest's: the whole prompt's
            obs.colsum = obs.colsum.copy()
            obs.colsum[:, :, :sums.shape[2]] += sums
        keep_s = 0.0
        dropped = None
        if extend and resident and into is not None:   # the prompt's cells stay where they are, in `seq`
            old = self.extension
            dropped = old.seq if old is not None and old.seq != seq else None
            colsum = None if obs is None or obs.colsum is None else np.ascontiguousarray(obs.colsum[:, :, :n],
                                                                                         np.float32)
            self.extension = Extension(tokens=list(prompt), snapshot=None, colsum=colsum, seq=seq,
                                       nbytes=(n - r) * session.bytes_per_cell())   # its own cells, in the context
        elif extend:
            self.extension = None   # one state held at a time: the old one goes before the new one is saved
            snap = session.save_seq(seq)
            colsum = None if obs is None or obs.colsum is None else np.ascontiguousarray(obs.colsum[:, :, :n],
                                                                                         np.float32)
            self.extension = Extension(tokens=list(prompt), snapshot=snap, colsum=colsum,
                                       nbytes=len(engines.saved_state(snap) or b""))
            keep_s = time.perf_counter() - t2
        t3 = time.perf_counter()
        plan = None
        if compresses:
            if obs is None:   # a policy that observes nothing (streamingllm) plans from positions alone
                obs = shape_observation(session.info, n)
            plan = make_plan(cfg.spec, cfg.params, cfg.budget, obs, session.engine)
            if on_step is not None:
                on_step(obs, plan)
            del obs
            if into is not None:
                session.gather(plan, seq, into)
            elif resident:   # `seq` shares the document's cells: its selection gathered apart, then handed back
                tmp = session.free_seq(seq, self.resident)
                session.gather(plan, seq, tmp)
                session.clear(seq)
                session.move_seq(tmp, seq)
            else:
                session.apply_plan(plan, seq=seq)
        # `seq` keeps the question's cells until the caller clears it after the answer: the answer's tokens then
        # follow the gathered block in cell order, as they follow a block compacted in place, and the same plan
        # decodes the same logits bit for bit (flash attention sums in cell order)
        out = into if into is not None and plan is not None else seq
        return Reselection(restored=r, prefilled=n - r, n_tokens=n, restore_s=t1 - t0, prefill_s=t2 - t1,
                           plan_s=time.perf_counter() - t3, plan=plan,
                           source=source, resident=resident, keep_s=keep_s,
                           reconstruct_s=recon_s, seq=out, dropped_seq=dropped,
                           window=window if "window" in kinds else None)

    # ------------------------------------------------------------------ the form, as a chat asks it
    # kvcli/apps/chat_reselected.py asks its store these, whichever form it holds (reselect_bounded.ChunkedStore
    # answers them for the bounded form); no caller tests which form it holds
    def held_cells(self, n_prompt: int, beside: int = 0) -> int:
        """The most cells a re-selection of a prompt of n_prompt tokens holds: the whole prompt before its
        compaction, and `beside` (a resident document's: the selection gathered beside it)."""
        return n_prompt + beside

    def serves(self, session: Session, cfg: Compression) -> bool:
        """Whether `cfg` is re-selected from the store as it was read: not where it scores by column sums the
        store holds none of (its reader then reads the document again, with them)."""
        return "colsum" not in cfg.observe[0] or self.colsum is not None

    def streamed_note(self) -> str:
        """What a question streams, in words after "re-selected per question" (/stats): nothing, it restores."""
        return ""

    def describe_read(self, where: str, budget: int | None, n_ctx: int) -> str:
        """How the document was read and stored and how a question is answered, in words (a chat's summary line,
        after "N tokens "); `where`: the store's place in words."""
        return (f"read in {self.read_s:.2f}s; full cache stored ({self.nbytes / 1e6:.2f} MB{where}); each question "
                f"is answered from {budget} entries per layer and KV head chosen for it")

    def describe_stored(self, n: int) -> str:
        """The stored document of n tokens, in words (a loaded chat's summary line)."""
        return f"{n} tokens stored"

    # ------------------------------------------------------------------ lifetime
    def save_as(self, path, session, turns: list | None = None) -> int:
        """Write the stored document (and the conversation's turns) to `path`; returns its size."""
        if self.snapshot is None and self.path is None and self.resident is not None:
            size = self.write_from(session, self.resident, path, list(turns or []))
        elif self.snapshot is not None:
            snap = self.snapshot
            if engines.saved_state(snap) is None:
                raise KvcliError("this stored document is held in memory by the reference engine: nothing to save")
            self.meta["turns"] = list(turns or [])
            size = kvc.write(path, self.to_kvc(session, snap.state))
        else:
            f = kvc.read(self.path)
            f.meta["conversation"]["turns"] = list(turns or [])
            size = kvc.write(path, f)
        document_store.register_kept(path, form="exact", model_path=session.model_path, tokens=self.tokens)
        return size

    def close(self) -> None:
        """Delete the stored file unless it is kept (a path the user named, or a file loaded with --cache); its
        document store entry is released (a temporary one removed, a kept one marked used now)."""
        if self.resident is not None and self.session.ctx is not None:
            self.drop_extension(self.session)
            self.session.clear(self.resident)   # the context's copy goes with the store
        self.resident = self.session = None
        if self.entry is not None:
            self.entry.release()
            self.entry = None
        if self.path is not None and not self.keep:
            self.path.unlink(missing_ok=True)
        self.snapshot = self.extension = None


def file_snapshot(f: kvc.KvcFile, state: bytes | None = None):
    """The saved sequence state of a stored document's .kvc file (`state`: a format-3 file's pieces joined), as
    `restore` puts it back."""
    from kvcli.engines import SeqSnapshot  # noqa: PLC0415
    c = f.meta["conversation"]
    return SeqSnapshot(state=f.state if state is None else state, next_pos=int(c["next_pos"]), cells=int(c["cells"]),
                       prompt_tokens=int(c["next_pos"]), rope=c.get("rope"))


class StoreMissing(KvcliError):
    """The stored document's file disappeared."""


class NoColsum(KvcliError):
    """A column-sum policy asked of a stored document read without column sums."""
