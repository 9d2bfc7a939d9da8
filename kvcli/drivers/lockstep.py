"""Many sequences in one context, decoded together at equal memory: the scheduling `kvcli batch` and
`kvcli bench --batch` share.

One llama.cpp context holds a unified pool of `n_ctx` cells and `n_seq` sequence slots. A sequence is
admitted while it fits: the cells it needs at its peak (its prefill, or the saved state it is
restored from) plus the `reserve` tokens it may decode must fit in what the held sequences leave,
counting for each of them the cells it occupies now and the tokens it may still decode. A compressed
document occupies few cells, so more of them are held, and decoded, at once: every `step` decodes one
token of every held sequence in one `llama_decode`. Reserving the whole answer up front means a held
sequence never runs out of room, whatever is admitted after it.
"""
from __future__ import annotations


class Lockstep:
    """The sequences held in `session`'s context and the decode tokens still reserved for each."""

    def __init__(self, session, reserve: int, cells: int | None = None):
        self.session = session
        self.reserve = reserve              # tokens each admitted sequence may decode
        self.cells = min(cells or session.n_ctx, session.n_ctx)   # llama.cpp may have rounded n_ctx up
        self.left: dict[int, int] = {}     # held sequence -> tokens it may still decode

    def free_seq(self) -> int | None:
        """A sequence slot that holds nothing, or None when all are taken."""
        return next((s for s in range(self.session.n_seq) if s not in self.left), None)

    def room(self) -> int:
        """Cells neither occupied nor reserved for the answers of the held sequences."""
        return self.cells - self.session.cells_used() - sum(self.left.values())

    def fits(self, peak_cells: int) -> bool:
        """Whether a sequence needing `peak_cells` before it decodes (and `reserve` after) can be admitted."""
        return self.free_seq() is not None and peak_cells + self.reserve <= self.room()

    def hold(self, seq: int) -> None:
        """`seq` has been filled (prefilled or restored): it decodes from now on. The cache is packed, so that the
        dead slots of every held compressed sequence, not only of the one at the start of the cache, go unstored
        (the ragged layout, native/src/kvcli_layout.cpp)."""
        self.left[seq] = self.reserve
        self.session.pack_cells()

    def step(self, tokens: dict[int, int]) -> None:
        """Decode one token for each listed held sequence, all in one batch."""
        self.session.step(tokens)
        for s in tokens:
            self.left[s] -= 1

    def release(self, seq: int) -> None:
        """Forget `seq` (held or not) and free its cells for the next admissions."""
        self.left.pop(seq, None)
        self.session.clear(seq)
        self.session.pack_cells()   # the freed cells gave their layers' rows back: trim by what is left
