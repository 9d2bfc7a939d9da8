"""A sequence's cache state in pieces: saved and restored a range of positions at a time, so that the process never
holds more than one piece of it (a stored document's full cache, kvcli/kvc.py format 3, is written from the context
and read back into it so; issue 62). NativeSession.save_seq_pieces / restore_seq_pieces call these.

A piece is llama.cpp's sequence state (llama_state_seq_get_data, with kvcli's prefix and bias suffix,
native/src/kvcli_state.cpp) of a scratch sequence holding positions [p, p + piece) of the sequence: in the context's
one cell pool (kv_unified) `llama_memory_seq_cp` gives those cells the scratch id as well, copying nothing, and the
state of the scratch sequence is that range's cells, each with its position. Restoring a piece into the empty scratch
sequence puts its cells back at those positions (llama.cpp finds free cells for them, contiguous or not), and
`seq_cp` hands them to the sequence; the scratch id is dropped after every piece. Only an uncompressed sequence
(one cell per position, no slot bias, no kvcli header) is saved so: a compressed one has per-head positions and a
bias that a range of cells does not describe.

Models with sliding-window layers: each piece also carries llama.cpp's window cache's cells of its range that lie
within the window of the piece's last position; the restored window cache holds at least the window the whole
sequence's state holds (the logits of the next token are the same), possibly older cells as well.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvcli.errors import KvcliError
from kvcli.native import cache

PIECE_CELLS = 256   # 3 MB a piece on qwen2.5-0.5b (12 KB a cell): what writing or reading a store adds to peak RSS


def _check_scratch(session, seq: int, scratch: int) -> None:
    session.seq(scratch)   # range check
    if scratch == seq:
        raise KvcliError(f"sequence {seq} cannot be its own scratch sequence")
    if session.seqs.get(scratch) and session.seqs[scratch].cells or session.measured_cells(scratch):
        raise KvcliError(f"sequence {scratch} holds cells: the scratch sequence must be empty")


def _drop(session, scratch: int) -> None:
    session.L.llama_memory_seq_rm(session.mem, scratch, -1, -1)
    session.seqs.pop(scratch, None)


def save_pieces(session, seq: int, scratch: int, piece_cells: int = PIECE_CELLS) -> Iterator[bytearray]:
    """The state of the uncompressed sequence `seq`, positions [p, p + piece_cells) one piece at a time (see the
    module docstring); `scratch` (an empty sequence of the context) is empty again after each piece, also when the
    caller stops early or a save fails. Checks are made when the first piece is asked for (a generator)."""
    st = session.seq(seq)
    _check_scratch(session, seq, scratch)
    if piece_cells < 1:
        raise KvcliError(f"pieces of {piece_cells} cells: at least one")
    n = st.next_pos
    if n == 0:
        raise KvcliError(f"sequence {seq} holds nothing to save")
    if (st.cells != n or st.kept_positions is not None or cache.is_compressed(session.ctx, seq)
            or session.measured_cells(seq) != n):
        raise KvcliError(f"sequence {seq} is compressed ({st.cells} cells, next position {n}): only an uncompressed "
                         "sequence is saved in pieces")
    for p in range(0, n, piece_cells):
        q = min(n, p + piece_cells)
        session.L.llama_memory_seq_cp(session.mem, seq, scratch, p, q)
        try:
            piece = cache.get_state(session.ctx, scratch)
        finally:
            _drop(session, scratch)
        yield piece
        del piece   # not held while the next one is made


def restore_pieces(session, pieces: Iterable, seq: int, scratch: int, next_pos: int, cells: int | None = None,
                   prompt_tokens: int | None = None, rope: str | None = None) -> int:
    """Replace `seq` by the uncompressed sequence whose state `pieces` holds (save_pieces' pieces, read one at a
    time): each is loaded into the empty sequence `scratch` and handed to `seq`. Returns the cells `seq` holds; it is
    then as restore_seq leaves it (next_pos, cells, prompt_tokens: next_pos unless given), checked the same way (the
    last position is next_pos - 1 and, when given, the cells are `cells`). On any failure (a piece refused, an
    interrupt) `seq` and `scratch` are left empty."""
    session.seq(seq)
    _check_scratch(session, seq, scratch)
    if rope and session.rope_regime and rope != session.rope_regime:
        raise KvcliError(f"the sequence was rotated with the {rope} LongRoPE factors, a context of "
                         f"{session.n_ctx} cells rotates with the {session.rope_regime} ones")
    session.clear(seq)   # room: checked by NativeSession.restore_seq_pieces (ContextFull is its error)
    L, mem = session.L, session.mem
    try:
        for piece in pieces:
            try:
                cache.set_state(session.ctx, scratch, piece)
                L.llama_memory_seq_cp(mem, scratch, seq, -1, -1)
            finally:
                _drop(session, scratch)
            del piece   # not held while the next one is read
        got = session.measured_cells(seq)
        pos_max = L.llama_memory_seq_pos_max(mem, seq)
        if pos_max != next_pos - 1 or (cells is not None and got != cells) or cache.is_compressed(session.ctx, seq):
            raise KvcliError(f"the cache state did not load as saved ({got} cells, last position {pos_max}; "
                             f"expected {cells if cells is not None else 'any number of'} cells, "
                             f"last position {next_pos - 1})")
    except BaseException:
        session.clear(seq)
        raise
    st = session.seq(seq)
    st.next_pos, st.cells = next_pos, got
    st.prompt_tokens = next_pos if prompt_tokens is None else prompt_tokens
    return got
