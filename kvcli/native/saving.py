"""Rolling back, saving and restoring a sequence of a NativeSession (kvcli/native/session.py): the one place outside
prefill/step/apply_plan that changes a SeqState; bench, eval, .kvc loading and the document store use these. A mixin
of NativeSession, kept apart so that session.py holds the context, the decode and the compaction."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcli.errors import ContextFull, KvcliError
from kvcli.native import cache, pieces


class SavingMixin:
    """NativeSession's rollback / truncate / save_seq / restore_seq / append_saved / pieces methods. They use the
    session's seq(), seqs, clear(), prefill(), cells_used(), ctx, mem, L, info, n_ctx and rope_regime."""

    def rollback(self, seq: int, n_tokens: int) -> None:
        """Forget the last `n_tokens` appended to `seq` (positions >= next_pos - n_tokens), e.g. to repeat a
        decode from the same cache. A compressed prefix is untouched: its cells sit at lower positions."""
        st = self.seq(seq)
        if n_tokens < 0 or n_tokens > st.next_pos:
            raise KvcliError(f"cannot roll back {n_tokens} tokens of sequence {seq} (it has {st.next_pos} positions)")
        if n_tokens == 0:
            return
        p0 = st.next_pos - n_tokens
        self.truncate(seq, p0)
        st.prompt_tokens = min(st.prompt_tokens, p0 + st.reindexed)

    def truncate(self, seq: int, pos: int) -> None:
        """Remove every cell of `seq` at position >= `pos` (llama_memory_seq_rm); the next token gets `pos`.
        Unlike `rollback`, it leaves `prompt_tokens` as it is (a conversation's /reset and failed turn)."""
        st = self.seq(seq)
        if not 0 <= pos <= st.next_pos:
            raise KvcliError(f"cannot truncate sequence {seq} at position {pos} (it has {st.next_pos} positions)")
        if self.info.sliding_layers and pos < st.next_pos:
            # the window cache reuses the cells of its oldest positions: the next token's window must still be there
            held_from = self.L.llama_memory_seq_pos_min(self.mem, seq)
            if held_from > max(0, pos - self.info.sliding_window + 1):
                raise KvcliError(f"cannot go back to position {pos} of sequence {seq}: the sliding-window layers' "
                                 f"cache holds positions >= {held_from} only, and the next token's window starts at "
                                 f"{max(0, pos - self.info.sliding_window + 1)}")
        if not self.L.llama_memory_seq_rm(self.mem, seq, pos, -1):
            raise KvcliError(f"llama.cpp refused to remove positions >= {pos} of sequence {seq}")
        st.next_pos = pos
        st.cells = self.measured_cells(seq)
        st.shared = min(st.shared, st.cells)
        st.logits_index, st.last_logits = -1, None  # the logits belonged to a removed token

    def measured_cells(self, seq: int = 0) -> int:
        """Cells `seq` occupies, read from the live cache."""
        return cache.stats(self.ctx, seq, self.info.n_layer_model, self.info.n_head_kv)["n_cells"]

    def save_seq(self, seq: int = 0) -> SeqSnapshot:
        """Everything needed to put `seq` back later, in this session or another one of the same model and
        cache type: its cache state (kvcli.native.cache.get_state) and its bookkeeping."""
        st = self.seq(seq)
        return SeqSnapshot(state=cache.get_state(self.ctx, seq), next_pos=st.next_pos, cells=self.measured_cells(seq),
                           prompt_tokens=st.prompt_tokens, kept_positions=st.kept_positions, reindexed=st.reindexed,
                           last_logits=None if st.last_logits is None else st.last_logits.copy(),
                           rope=self.rope_regime)

    def restore_seq(self, snap: SeqSnapshot, seq: int = 0) -> int:
        """Replace `seq` by a snapshot (its previous cells are dropped); returns the cells it occupies.
        The loaded cache is checked against the snapshot: its last position must be next_pos - 1 and,
        when the snapshot knows them, its cells must match."""
        self.seq(seq)  # range check
        if snap.rope and self.rope_regime and snap.rope != self.rope_regime:
            raise KvcliError(f"the sequence was rotated with the {snap.rope} LongRoPE factors, a context of "
                             f"{self.n_ctx} cells rotates with the {self.rope_regime} ones")
        if self.cells_used() - self.seqs[seq].cells + (snap.cells or 0) > self.n_ctx:
            raise ContextFull(f"a {snap.cells}-cell sequence does not fit: {self.cells_used()} of {self.n_ctx} "
                              "cells are in use")
        self.clear(seq)
        cache.set_state(self.ctx, seq, snap.state)
        cells = self.measured_cells(seq)
        pos_max = self.L.llama_memory_seq_pos_max(self.mem, seq)
        if pos_max != snap.next_pos - 1 or (snap.cells is not None and cells != snap.cells):
            self.clear(seq)
            raise KvcliError(f"the cache state did not load as saved ({cells} cells, last position {pos_max}; "
                             f"expected {snap.cells if snap.cells is not None else 'any number of'} cells, "
                             f"last position {snap.next_pos - 1})")
        st = self.seq(seq)
        st.next_pos, st.cells, st.prompt_tokens = snap.next_pos, cells, snap.prompt_tokens
        st.kept_positions = snap.kept_positions
        st.reindexed = snap.reindexed
        if snap.last_logits is not None:
            st.last_logits, st.logits_index = snap.last_logits.copy(), 0
        return cells

    def append_saved(self, snap: SeqSnapshot, seq: int, spare: int, filler: int) -> int:
        """Append the cells of a saved uncompressed sequence after those of `seq` (compressed or not), moved to the
        positions that continue it: loaded into the empty sequence `spare`, shifted (llama.cpp's K-shift re-rotates
        the K rows; it is settled at once by decoding the token `filler` in `spare`, then removed, so that a
        compaction may follow), then handed to `seq` (seq_cp, and `spare` dropped). Returns the cells appended."""
        if spare == seq or self.seqs.get(spare) and self.seqs[spare].cells:
            raise KvcliError(f"sequence {spare} is not a free sequence to load through")
        st = self.seq(seq)
        n = self.restore_seq(snap, spare)
        try:
            delta = st.next_pos - self.L.llama_memory_seq_pos_min(self.mem, spare)
            if delta:
                self.L.llama_memory_seq_add(self.mem, spare, -1, -1, delta)
                self.seqs[spare].next_pos += delta
                self.prefill([filler], seq=spare)
                self.truncate(spare, self.seqs[spare].next_pos - 1)
            self.L.llama_memory_seq_cp(self.mem, spare, seq, -1, -1)
        finally:
            self.clear(spare)
        st.next_pos = self.L.llama_memory_seq_pos_max(self.mem, seq) + 1
        st.cells += n
        st.prompt_tokens += n
        st.logits_index, st.last_logits = -1, None
        return n

    def save_seq_pieces(self, seq: int, scratch: int, piece_cells: int = pieces.PIECE_CELLS):
        """The state of the uncompressed `seq`, positions [p, p + piece_cells) a piece at a time, through the empty
        sequence `scratch` (kvcli/native/pieces.py): a stored document's file written without a whole copy."""
        return pieces.save_pieces(self, seq, scratch, piece_cells)

    def restore_seq_pieces(self, parts, seq: int, scratch: int, next_pos: int, cells: int | None = None,
                           prompt_tokens: int | None = None, rope: str | None = None) -> int:
        """restore_seq of save_seq_pieces' pieces, read one at a time (kvcli/native/pieces.py)."""
        self.seq(seq)  # range check
        want = next_pos if cells is None else cells
        if self.cells_used() - self.seqs[seq].cells + want > self.n_ctx:
            raise ContextFull(f"a {want}-cell sequence does not fit: {self.cells_used()} of {self.n_ctx} "
                              "cells are in use")
        return pieces.restore_pieces(self, parts, seq, scratch, next_pos, cells, prompt_tokens, rope)


@dataclass
class SeqSnapshot:
    """A saved sequence (NativeSession.save_seq / restore_seq). `cells=None`: not known (e.g. a state read from a
    file without it), restore_seq then only checks the last position."""
    state: bytes
    next_pos: int
    cells: int | None = None
    prompt_tokens: int = 0
    kept_positions: list | None = None
    last_logits: np.ndarray | None = None
    reindexed: int = 0   # SeqState.reindexed: positions re-indexing gave back
    rope: str | None = None   # a LongRoPE model's factors the K rows were rotated with ("short"/"long")
