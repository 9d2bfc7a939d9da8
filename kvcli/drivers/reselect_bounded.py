"""Bounded re-selection: a document whose full cache should not be held at once, stored chunk by chunk as bounded
reading reads it, and re-selected for every question by streaming the stored chunks.

Exact re-selection (kvcli/drivers/reselect.py) restores the document's whole full cache for every question: its
peak is the full cache. Here the cache never holds more than the entries kept so far + one chunk (+ a probe):

    reading (once): bounded reading (kvcli/drivers/chunked.py, each chunk scored by its own last window, no
        question being known) with every chunk's entries saved to the store after its prefill, before the
        compaction: the store is written chunk by chunk and never costs the full cache in RAM (the store, its
        reading, its folder and its files: kvcli/drivers/chunked_store.py).
    per question, which chunks: by the block index (kvcli/drivers/block_index.py, stored with the chunks), the
        question's queries computed once and scored against every chunk's per-page key bounds: the first chunk, the
        last and the `chunks_per_question` best between them are streamed, so a question's cost hardly grows with
        the document (every chunk where there is no index: KVCLI_RESELECT_CHUNKS=all, a format 2 store).
    per question: the chosen stored chunks are put back one after the other beside the entries kept so far (moved to
        the positions that follow them: llama.cpp's K-shift) while they fit the context's free cells; when the next
        would not fit, the held ones are scored by the question prefilled as a probe (its last `window` queries
        observed) and rolled back (FINCH, as bounded reading scores its chunks), planned to the budget and compacted
        with re-indexing; then the rest of the prompt (the document's last tokens, the conversation, the question)
        is prefilled with the observation armed, planned and compacted like any last chunk.
    a conversation's turns: before that last compaction, the cells of the prompt's tokens after the document are
        saved (in memory, `TurnChunks`: one chunk per question, its answer before it and the question); the next
        question streams them after the stored chunks like more stored chunks (probed, compacted) and prefills only
        the last answer and the new question, so a question's cost does not grow with the turns before it. The
        cache bound becomes kept + the larger of a chunk and one turn (a turn is an answer and a question: below a
        1024-token chunk unless --max-tokens is larger). The held cells are probed and compacted only when the
        next chunk would not fit beside them (kept + chunk), so short turns accumulate without a probe of their own.

What the stored entries are: each chunk's K/V as bounded reading computed them, attending to the entries kept when
the document was read (chosen without the question), not to the whole document. So a re-selection here is
question-aware in what it keeps, while the entries it keeps carry the reading's approximation;
docs/results/chat-and-reselection.md
("Bounded re-selection") measures what that costs against exact re-selection. Models with sliding-window layers
are read without re-indexing and get exact re-selection only; column-sum policies are refused: their
scores sum every query, and the chunks' own queries are not replayed. The kept turns' K/V are the same kind of
approximation: computed when their question was re-selected, attending to the entries kept for that question.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from kvcli.config import env_bytes
from kvcli.drivers import block_index
from kvcli.drivers.chunked import probe_window
from kvcli.drivers.chunked_store import (CHUNK_TYPES, FORMAT, MANIFEST, READS, SUMMARY, BoundedStore, StoredChunk,
                                         _snapshot_of, check_store_target, check_usable, is_store, read_manifest,
                                         replace_folder, store_types, write_manifest)
from kvcli.drivers.reselect import Reselection, common_prefix
from kvcli.errors import KvcliError
from kvcli.engines import SeqSnapshot, cells_from, chunk_keys, kv_reader, seq_positions
from kvcli.planning.planner import Compression, make_plan, session_cells, shape_observation

# the store's names, imported from here by kvcli's commands and apps
__all__ = ["CHUNK_TYPES", "EXACT_BELOW_BYTES", "FORMAT", "MANIFEST", "READS", "SUMMARY", "BoundedReselection",
           "BoundedStore", "ChunkedStore", "Origins", "StoredChunk", "TurnChunk", "TurnChunks", "check_store_target",
           "check_usable", "EXACT_ENV", "exact_below_bytes", "is_store", "read_manifest", "replace_folder",
           "store_types", "write_manifest"]

# A re-selected chat keeps the exact form (the document's full cache held while a question is re-selected) up to
# this many bytes of full cache, though bounded reading would read the document in chunks: a bounded re-selection
# streams every chunk with a probe, about 1.5x the seconds of an exact one per question (8k, measured on a loaded
# machine: docs/results.md,
# "Bounded re-selection"), and a full cache this size is a moderate addition to the process. Above it, past the
# model's context, or with --chunk N / --max-cache, the bounded form. KVCLI_RESELECT_EXACT_MB moves it.
EXACT_BELOW_BYTES = 256 << 20
EXACT_ENV = "KVCLI_RESELECT_EXACT_MB"


def exact_below_bytes() -> int:
    return env_bytes(EXACT_ENV, EXACT_BELOW_BYTES)


@dataclass
class BoundedReselection(Reselection):
    """A bounded re-selection: restore_s counts putting the stored chunks back, prefill_s their probes and the rest."""
    chunks: int = 0

    stored: int = 0          # chunks in the store (`chunks`: those streamed, with the kept turns)
    index_s: float = 0.0     # choosing them: the question's queries and the block index (kvcli/drivers/block_index.py)
    origins: "Origins | None" = None   # the prompt token each kept entry holds (kvcli/citations.py cites from it)
    streamed: list | None = None   # the stored chunks streamed (their indices), in document order

    def as_stats(self) -> dict:
        return {**super().as_stats(), "reselect_chunks": self.chunks, "stored_chunks": self.stored,
                "index_s": round(self.index_s, 4)}



@dataclass
class Origins:
    """Where the entries of a bounded re-selection came from: per (layer, KV head), the prompt token (its index in
    `tokens`) each position of the sequence holds, -1 where that head holds nothing. A re-indexing compaction gives
    the kept entries new positions, right-aligned per head (Plan.first_slot), so the sequence's own bookkeeping no
    longer knows their place in the document; this follows them through every chunk put back (`append`), cut
    (`truncate`) and compaction (`compact`: the kept entries of each head in the order of their positions, as the
    native compaction lays them out, kvcli_moves.cpp plan_moves). A few int32 per position and head: cheap enough to
    keep for every question."""
    tokens: list[int]
    of: np.ndarray                    # [n_layer, n_head_kv, positions] int32

    @classmethod
    def start(cls, info, tokens: list[int]) -> "Origins":
        return cls(list(tokens), np.zeros((info.n_layer, info.n_head_kv, 0), np.int32))

    def append(self, pos0: int, first_token: int, n: int) -> None:
        """Positions pos0..pos0+n-1 hold tokens first_token.. in every head."""
        width = self.of.shape[2]
        if width < pos0 + n:
            self.of = np.concatenate([self.of, np.full(self.of.shape[:2] + (pos0 + n - width,), -1, np.int32)], 2)
        self.of[:, :, pos0:pos0 + n] = np.arange(first_token, first_token + n, dtype=np.int32)

    def truncate(self, pos: int) -> None:
        self.of = self.of[:, :, :pos]

    def compact(self, cell_pos: np.ndarray, plan) -> None:
        """After a re-indexing compaction of the sequence whose cells had positions `cell_pos` (cell order)."""
        B = plan.max_kept
        new = np.full(self.of.shape[:2] + (B,), -1, np.int32)
        off = plan.offsets()
        for il in range(plan.n_layer):
            for h in range(plan.n_head_kv):
                k = plan.slots[off[il, h]:off[il, h] + plan.n_kept[il, h]]
                p = np.sort(cell_pos[k], kind="stable")
                new[il, h, B - len(p):] = self._at(il, h, p)
        self.of = new

    def _at(self, il: int, h: int, pos: np.ndarray) -> np.ndarray:
        ok = (pos >= 0) & (pos < self.of.shape[2])
        return np.where(ok, self.of[il, h][np.where(ok, pos, 0)], -1)

    def slot_origins(self, session, seq: int) -> list[list[np.ndarray]]:
        """Per (layer, KV head), the prompt token each slot (cell, in cell order) of `seq` holds, -1 for a dead
        slot or one past the prompt (an answer's token): NativeSession._slot_origins for a re-indexed sequence."""
        pos = seq_positions(session, seq)
        return [[self._at(il, h, pos) for h in range(self.of.shape[1])] for il in range(self.of.shape[0])]


@dataclass
class TurnChunk:
    """The cells of some of a conversation's tokens after the stored document (kept in memory, not stored), as a
    re-selection prefilled them: first_token in the prompt, n cells from position first_pos."""
    first_token: int
    n: int
    first_pos: int
    state: bytes

    @property
    def nbytes(self) -> int:
        return len(self.state)

    def snapshot(self) -> SeqSnapshot:
        return SeqSnapshot(state=self.state, next_pos=self.first_pos + self.n, cells=self.n, prompt_tokens=self.n)


@dataclass
class TurnChunks:
    """A conversation's turns kept for the next question (ChunkedStore.reselect(extend=True)): the cells of
    `tokens[store.split:]` in chunks, one per question (the answer before it and the question), each as the
    re-selection of its question prefilled it, before the compaction. The next question streams them after the
    stored chunks, as more chunks, and prefills only what is new (the last answer and the new question)."""
    tokens: list[int]                 # the whole prompt they end
    chunks: list[TurnChunk]

    @property
    def split(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def describe(self, n_tokens: int) -> str:
        """Where the conversation's turns (`n_tokens` after the document) are kept, in words (a chat's /stats)."""
        return (f"the conversation's full cache kept in memory: {n_tokens} tokens after the document "
                f"({self.nbytes / 1e6:.2f} MB in {len(self.chunks)} turn chunks)")


@dataclass
class ChunkedStore(BoundedStore):
    """A bounded store (kvcli/drivers/chunked_store.py) re-selected per question (see the module doc). Same use as
    reselect.StoredDocument: read once, `reselect` per question, `close`."""
    extension: TurnChunks | None = None   # the conversation's turns, as the last re-selection computed them
    select: int | None = None        # chunks a question streams besides the first and last (None: automatic,
                                     # 0: every chunk); KVCLI_RESELECT_CHUNKS ("all" or N) overrides it
    form = "bounded"                 # its name in stats and store records (reselect.StoredDocument: "exact")
    can_be_resident = False          # its chunks are streamed for every question, never held whole
    tag = ", bounded"                # after "re-selected per question" in a chat's summary line

    # ------------------------------------------------------------------ per question
    def reselect(self, session, prompt: list[int], cfg: Compression, *, seq: int = 0, spare: int | None = None,
                 progress=None, on_step=None, extend: bool = False, cells: int | None = None,
                 window_from: str = "policy") -> Reselection:
        """Stream the stored chunks into `seq` beside the entries kept so far, each scored by the prompt's last
        window and compacted to the budget, then prefill the rest of `prompt` with the observation armed, plan
        and compact: `seq` then holds `prompt` compressed for its question, ready to decode. `on_step(obs, plan)`
        is called before each plan is applied. `spare`: the sequence chunks are loaded through (default seq + 1).
        `cells`: the most cells the question may hold (the chunks, the rest of the prompt); None: the context's free
        cells; at least the budget + a chunk + the probe, the bound of the read.

        A conversation (`extend`): the cells of the prompt's tokens after the stored document, as this question's
        prefill computed them (before the compaction), are kept in memory (`extension`, TurnChunks); the next
        question, whose prompt starts with this one, streams them after the stored chunks as more chunks and
        prefills only the last answer and its question (or the policy's window, when that is longer): no question
        prefills the earlier turns again. Where the prompt leaves the kept one (an interrupted turn dropped,
        /reset), the kept chunks up to where they differ are used and the rest prefilled.

        `window_from`: taken as StoredDocument.reselect takes it; the bounded form scores by the policy's whole
        window ("policy") whatever it says: its chunks are probed by the prompt's last tokens, and the policy's
        window is prefilled after them."""
        spare = seq + 1 if spare is None else spare
        check_usable(session, cfg, spare)
        n = len(prompt)
        if common_prefix(self.tokens, prompt) < self.split:
            raise KvcliError("the prompt does not start with the stored document's tokens")
        kinds, window = cfg.observe
        reach = window if "window" in kinds else 0
        turns, end, anchor = self._turns_for(prompt, reach)
        # the question's window must lie in what is prefilled now: the last chunk gives back what it lacks
        base = min(end, n - reach) if reach else end
        probe = self.question_probe(prompt, base, window) if "window" in kinds else []
        if seq in session.seqs:
            session.clear(seq)
        stored, index_s = self._choose(session, seq, prompt, cfg)
        index = {id(c): i for i, c in enumerate(self.chunks)}
        streamed = stored + turns
        last_first = streamed[-1].first_token if streamed else 0
        if base < last_first:
            raise KvcliError(f"the policy's window ({window}) reaches past the stored document's last chunk")
        cut = (streamed[-1].first_token + streamed[-1].n - base) if streamed else 0
        # the cells held before a probe: at least the kept entries and a chunk, leaving the probe room (as the reading
        # does), and as many chunks as the context's free cells hold beside the rest of the prompt (`cells`). The
        # held cells are probed and compacted only when the next chunk would not fit beside them: chunks that fit
        # together are re-selected together, by the question's own window, without a probe of their own
        rest = n - base
        room = session.n_ctx - session.cells_used() if cells is None else cells
        limit = max(cfg.budget + self.chunk, room - max(rest - len(probe), 0)) - len(probe)
        restore_s = prefill_s = plan_s = 0.0
        plan = None
        origins = Origins.start(session.info, prompt)
        for i, c in enumerate(streamed):
            t0 = time.perf_counter()
            cells = session_cells(session, seq) if i else 0
            if i and cells + c.n > limit and cfg.spec.compresses(cells, cfg.budget):
                obs = (probe_window(session, seq, probe, None, window) if probe
                       else shape_observation(session.info, cells))
                if "kv" in kinds:   # the held entries' K/V rows, read by the planner when it asks (kind kv)
                    obs.kv_reader = kv_reader(session, seq, obs.positions)
                t1 = time.perf_counter()
                prefill_s += t1 - t0
                plan = self._compact(session, seq, cfg, obs, on_step, origins)
                t0 = time.perf_counter()
                plan_s += t0 - t1
            snap = c.snapshot() if isinstance(c, TurnChunk) else self._snapshot(c)
            origins.append(session.seq(seq).next_pos, c.first_token, c.n)
            session.append_saved(snap, seq, spare, filler=int(prompt[-1]))
            if i == len(streamed) - 1 and cut:
                session.truncate(seq, session.seq(seq).next_pos - cut)
                origins.truncate(session.seq(seq).next_pos)
            restore_s += time.perf_counter() - t0
        t1 = time.perf_counter()
        rest = list(prompt[base:])
        first_pos = session.seq(seq).next_pos          # the position of prompt[base]
        obs = session.prefill(rest, seq=seq, observe=kinds, window=window, progress=progress)
        origins.append(first_pos, base, len(rest))
        t2 = time.perf_counter()
        prefill_s += t2 - t1
        kept = None
        if extend:   # the turns' cells from `anchor` on, before the compaction: the next question's last chunks
            state, cells, _ = cells_from(session.save_seq(seq).state, first_pos - (base - anchor))
            if cells != n - anchor:
                raise KvcliError(f"the conversation's cells: {cells} saved, {n - anchor} prefilled")
            keep = [c for c in turns if c.first_token < anchor]
            kept = TurnChunks(tokens=list(prompt), chunks=keep + [TurnChunk(anchor, n - anchor,
                                                                              first_pos - (base - anchor), state)])
        t3 = time.perf_counter()
        cells = session_cells(session, seq)
        if cfg.spec.compresses(cells, cfg.budget):
            plan = self._compact(session, seq, cfg, obs if obs is not None else shape_observation(session.info, cells),
                                 on_step, origins)
        plan_s += time.perf_counter() - t3
        if extend:
            self.extension = kept
        return BoundedReselection(restored=base, prefilled=len(rest), n_tokens=n, restore_s=restore_s,
                                  prefill_s=prefill_s, plan_s=plan_s, plan=plan, chunks=len(streamed),
                                  source="conversation" if turns else "document", keep_s=t3 - t2,
                                  stored=len(self.chunks), index_s=index_s, origins=origins,
                                  streamed=[index[id(c)] for c in stored])

    # ------------------------------------------------------------------ the form, as a chat asks it
    # (reselect.StoredDocument answers the same for the exact form)
    def held_cells(self, n_prompt: int, beside: int = 0) -> int:
        """The most cells a re-selection of a prompt of n_prompt tokens holds: the kept entries and a chunk
        (`cap`), then the rest of the prompt after the stored document; `beside`: as StoredDocument.held_cells
        (0: never resident)."""
        return n_prompt - self.split + self.cap + beside

    def serves(self, session, cfg: Compression) -> bool:
        """Whether `cfg` is re-selected from the store as it was read: always, or refused in check_usable's one
        message (column sums or maxima, ...): the document is read in chunks once, never again for a policy."""
        check_usable(session, cfg)
        return True

    def drop_extension(self, session=None) -> None:
        """Forget the kept turns (in memory only: nothing in the context to free)."""
        self.extension = None

    def streamed_note(self) -> str:
        """What a question streams, in words after "re-selected per question" (/stats)."""
        return f" (bounded: {len(self.chunks)} stored chunks streamed)"

    def describe_read(self, where: str, budget: int | None, n_ctx: int) -> str:
        """How the document was read and stored and how a question is answered, in words (a chat's summary line,
        after "N tokens "); `where`: the store's place in words."""
        return (f"read in chunks of {self.chunk} in {self.read_s:.2f}s and stored as read ({len(self.chunks)} "
                f"chunks, {self.nbytes / 1e6:.2f} MB{where}); each question streams {self.streamed_words(budget)} "
                f"through the context's {n_ctx} cells and is answered from {budget} entries per layer and KV head "
                "chosen for it")

    def describe_stored(self, n: int) -> str:
        """The stored document of n tokens, in words (a loaded chat's summary line)."""
        return f"{n} tokens stored in {len(self.chunks)} chunks"

    def streamed_words(self, budget: int) -> str:
        """Which stored chunks a question streams at `budget`, in words."""
        select = self.chunks_per_question(budget)
        if select is None or len(self.chunks) <= select + 2:
            return "them all"
        return f"the first, the last and the {select} its block index scores best (page bounds, then real keys)"

    def chunks_per_question(self, budget: int) -> int | None:
        """How many stored chunks a question streams besides the first and the last, by the block index; None: every
        chunk (no index: a format 2 store, a model whose RoPE kvcli cannot turn; KVCLI_RESELECT_CHUNKS=all)."""
        env = os.environ.get("KVCLI_RESELECT_CHUNKS", "").strip().lower()
        if env:
            if env == "all":
                return None
            if not env.isdigit() or int(env) < 1:
                raise KvcliError(f"KVCLI_RESELECT_CHUNKS must be 'all' or a whole number >= 1 (got '{env}')")
            return int(env)
        if self.select is not None:
            return self.select or None
        if not self.pages or self.summary is None:
            return None
        return block_index.default_select(budget, self.chunk)

    def _choose(self, session, seq: int, prompt: list[int], cfg: Compression) -> tuple[list[StoredChunk], float]:
        """The stored chunks this question streams (in document order) and the seconds choosing them took. Every
        chunk, or, by the block index (kvcli/drivers/block_index.py), the first, the last and the
        `chunks_per_question` between them whose real keys score best of the CANDIDATES x as many that the page
        bounds score best. `seq` is empty before and after."""
        select = self.chunks_per_question(cfg.budget)
        if select is None or len(self.chunks) <= select + 2 or not self.pages or self.summary is None:
            return list(self.chunks), 0.0
        t0 = time.perf_counter()
        candidates, keys = self.ranked(session, seq, prompt, select)
        best = sorted(candidates[j] for j in block_index.choose(keys, select))
        chosen = [self.chunks[0]] + [self.chunks[1 + i] for i in best] + [self.chunks[-1]]
        return chosen, time.perf_counter() - t0

    def ranked(self, session, seq: int, prompt: list[int], select: int) -> tuple[list[int], np.ndarray]:
        """The index's two steps for the question that ends `prompt`: the page bounds' best CANDIDATES x `select`
        chunks (indices among those between the first and the last, ascending) and their real keys' scores."""
        q = self.question_queries(session, seq, prompt)
        candidates = block_index.choose(self._page_scores(q, session.info), block_index.CANDIDATES * select)
        return candidates, self.key_scores(q, session.info, candidates)

    def index_scores(self, session, seq: int, prompt: list[int]) -> np.ndarray:
        """The block index's page-bound score of every chunk between the first and the last for the question that
        ends `prompt` (the first of _choose's two steps): its queries computed once over the stored summary (in
        `seq`, empty before and after)."""
        return self._page_scores(self.question_queries(session, seq, prompt), session.info)

    def key_scores(self, q: np.ndarray, info, inner: list[int]) -> np.ndarray:
        """The chunks `inner` (indices among those between the first and the last) scored as the page bounds score
        them, with their real keys' largest logits: the index's second step. One chunk file at a time (the chosen
        ones are read again to be restored): a question holds no more memory than streaming a chunk does."""
        lay = block_index.layers(info.n_layer)
        return block_index.chunk_scores([block_index.key_maxima(q[lay], chunk_keys(self._read_chunk(self.chunks[1 + i]),
                                                                                   info.n_head_kv, lay)[0])
                                         for i in inner])

    def _page_scores(self, q: np.ndarray, info) -> np.ndarray:
        lay = block_index.layers(info.n_layer)
        return block_index.chunk_scores([block_index.chunk_maxima(q[lay], *(b[lay] for b in block_index.load_pages(
            self._read_file(f), info))) for f in self.pages[1:-1]])

    def question_queries(self, session, seq: int, prompt: list[int]) -> np.ndarray:
        """The queries of the question that ends `prompt`, prefilled after the stored summary (in `seq`, empty
        before and after) and turned to the position past every stored key (block_index.question_queries)."""
        session.restore_seq(_snapshot_of(self.summary, self._read_file(self.summary)), seq)
        try:
            probe = block_index.question_tokens(prompt, self.split)
            free = session.n_ctx - session.cells_used()     # a context sized for a chunk holds the question
            return block_index.question_queries(session, seq, probe[max(len(probe) - free, 0):],
                                                at=self.cap, rows=block_index.PROBE_ROWS)
        finally:
            session.clear(seq)

    @staticmethod
    def question_probe(prompt: list[int], base: int, window: int) -> list[int]:
        """What is prefilled after the held cells to score them: what this question prefills after the streamed
        chunks (prompt[base:]: the question, after a conversation's kept turns the last answer too), its last
        block_index.QUESTION_TOKENS at most and the policy's `window` at least. The window's queries then have seen
        the whole question: the prompt's last `window` tokens alone hold its instruction and the chat template's end,
        not the passage it asks about (a corpus question quotes 40-150 tokens and ends "Answer with the number
        only."; docs/results/real-text.md, "The bounded form's probe"). In a conversation the last answer stays in
        it, as it is in what the last step observes (a follow-up question may need it): probing from the question's
        own turn instead answered 27 of five planted-fact chats' 30 questions against 26 ("A conversation's probe"). A
        question shorter than the window is probed as before, at no more cost; the probe is never longer than the
        rest of the prompt, which the last step holds beside the same cells, so it does not raise the re-selection's
        peak."""
        return list(prompt[-max(min(len(prompt) - base, block_index.QUESTION_TOKENS), window):])

    def _turns_for(self, prompt: list[int], reach: int) -> tuple[list[TurnChunk], int, int]:
        """The kept turn chunks that `prompt` starts with, how far they reach into it exactly, and where the chunk
        this question keeps begins (`anchor`): ([], split, split) without them. A kept chunk that the prompt leaves
        part-way is cut there and replaced by the new one (anchor = its first token); one the policy's window
        reaches into is cut for the prefill only (its cells stay right)."""
        ext = self.extension
        n = len(prompt)
        if ext is None or not ext.chunks:
            return [], self.split, self.split
        same = min(common_prefix(ext.tokens, prompt), ext.split, n - 1)
        turns = [c for c in ext.chunks if c.first_token < same]
        if not turns or (reach and min(same, n - reach) < turns[-1].first_token):
            return [], self.split, self.split
        last = turns[-1]
        whole = last.first_token + last.n <= same
        return turns, (last.first_token + last.n if whole else same), (last.first_token + last.n if whole
                                                                        else last.first_token)

    @staticmethod
    def _compact(session, seq, cfg: Compression, obs, on_step, origins: Origins | None = None):
        plan = make_plan(cfg.spec, cfg.params, cfg.budget, obs, session.engine)
        if on_step is not None:
            on_step(obs, plan)
        cell_pos = seq_positions(session, seq) if origins is not None else None
        session.apply_plan(plan, seq=seq, reindex=True)
        if origins is not None:
            origins.compact(cell_pos, plan)
        return plan

