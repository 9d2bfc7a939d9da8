"""Documents held resident in the context: a document's full cache read (or restored) once into a sequence of its
own, every question about it sharing those cells and gathering its selection beside them (kvcli_gather_plan;
native/src/README.md, "A resident document"):

    context cells   [ document A (sequence 3) ][ document B (4) ][ question (2) ][ A's or B's selection (0) ]...
                      shared into 2 up to the restore point ^          prefilled with observation, planned,
                                                                       gathered into 0, decoded, both freed

A question then costs its own prefill over a cache already resident, a plan and a gather of B rows a (layer, KV
head): no restore, no copy of the full cache (docs/results/serve.md). `Residents` decides which documents the
context holds: least recently used freed first when a sequence or the cells are needed. A document that cannot be
read again from its file keeps its cache as an in-memory snapshot when it is freed (`StoredDocument.evict`); one
held resident has no snapshot (the cache is held once).
"""
from __future__ import annotations

import time
from collections import OrderedDict

import numpy as np

from kvcli.drivers.reselect import StoredDocument
from kvcli.errors import KvcliError


class Residents:
    """The documents resident in `session`'s context, one sequence each out of `seqs`, least recently used first."""

    def __init__(self, session, seqs):
        self.session = session
        self.seqs = list(seqs)
        self.docs: OrderedDict[int, StoredDocument] = OrderedDict()   # sequence -> its document
        self.freed = 0   # documents freed to make room

    def __contains__(self, doc) -> bool:
        return doc.resident is not None and self.docs.get(doc.resident) is doc

    def cells(self) -> int:
        """Cells the resident documents hold."""
        return sum(d.split for d in self.docs.values())

    def read(self, tokens: list[int], split: int, colsum: bool, room: int, progress=None) -> StoredDocument:
        """Prefill tokens[:split] into a sequence of its own (observing the column sums with `colsum`) and keep it
        there: a new resident document, not yet written anywhere. `room`: the cells the request needs beside it."""
        seq = self._make_room(split + room)
        t0 = time.perf_counter()
        try:
            obs = self.session.prefill(list(tokens[:split]), seq=seq, observe=("colsum",) if colsum else (),
                                       progress=progress)
        except BaseException:
            self.session.clear(seq)
            raise
        read_s = time.perf_counter() - t0
        sums = None if obs is None or obs.colsum is None else np.ascontiguousarray(obs.colsum[:, :, :split],
                                                                                   np.float32)
        doc = StoredDocument(tokens=list(tokens[:split]), split=split, colsum=sums, read_s=read_s, keep=False,
                             nbytes=split * self.session.bytes_per_cell())
        doc.resident, doc.session = seq, self.session
        self.docs[seq] = doc
        return doc

    def hold(self, doc: StoredDocument, room: int) -> None:
        """Make `doc` resident (restored once from its file or snapshot), most recently used; `room`: the cells the
        request needs beside it."""
        self._forget_closed()
        if doc in self:
            self.docs.move_to_end(doc.resident)
            return
        seq = self._make_room(doc.split + room, keep=doc)
        doc.make_resident(self.session, seq)
        self.docs[seq] = doc

    def release(self, doc: StoredDocument) -> None:
        """Free `doc`'s sequence (its cache kept as a snapshot when no file holds it)."""
        if doc in self:
            del self.docs[doc.resident]
            doc.evict(self.session)

    def _forget_closed(self) -> None:
        """Documents a store closed (evicted) have given their sequence back (StoredDocument.close)."""
        for seq, doc in list(self.docs.items()):
            if doc.resident != seq:
                del self.docs[seq]
                if self.session.seqs.get(seq) is not None:
                    self.session.clear(seq)

    def _make_room(self, cells: int, keep: StoredDocument | None = None) -> int:
        """A free sequence, with `cells` free cells beside what the context holds: least recently used documents
        (other than `keep`) are freed until there are."""
        self._forget_closed()
        s = self.session
        while True:
            free = [q for q in self.seqs if q not in self.docs and not s.seq(q).cells]
            if free and s.cells_used() + cells <= s.n_ctx:
                return free[0]
            if not self._free_one(keep):
                raise self._no_room(cells, bool(free))

    def _victims(self, keep: StoredDocument | None) -> list[StoredDocument]:
        """Documents that may be freed for room, least recently used first."""
        return [d for d in self.docs.values() if d is not keep]

    def _free_one(self, keep: StoredDocument | None) -> bool:
        victims = self._victims(keep)
        if not victims:
            return False
        self.release(victims[0])
        self.freed += 1
        return True

    def _no_room(self, cells: int, any_free: bool) -> Exception:
        s = self.session
        if not any_free:
            return KvcliError("no sequence is free for another resident document")
        return KvcliError(f"the document needs {cells} cells with its request: {s.cells_used()} of the "
                          f"context's {s.n_ctx} are in use")

    def close(self) -> None:
        for doc in list(self.docs.values()):
            self.release(doc)
