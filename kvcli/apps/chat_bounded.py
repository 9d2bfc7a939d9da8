"""The bounded form of a re-selected conversation (kvcli/apps/chat_reselected.py: what both forms share): the document
stored chunk by chunk as bounded reading reads it (kvcli/drivers/reselect_bounded.py), the cache never holding more
than the budget and a chunk; its chunks streamed for every question.
"""
from __future__ import annotations

import time
from pathlib import Path

from kvcli import doc_formats
from kvcli.apps.chat_base import Turn
from kvcli.apps.chat_reselected import Reselected, model_for
from kvcli.drivers.chunked import TURN_ROOM, pad_cells
from kvcli.drivers.reselect import common_prefix
from kvcli.drivers.reselect_bounded import ChunkedStore, check_usable, read_manifest, store_types
from kvcli.errors import KvcliError
from kvcli.engines import open_native
from kvcli.planning.planner import CompressReport


class ReselectedBounded(Reselected, kind="bounded"):
    """Re-selected per question from the document's stored chunks (a ChunkedStore: a store folder, or temporary
    files), streamed beside the entries kept so far; never resident, the context holding the budget, a chunk and the
    conversation."""

    def _read_document(self, cfg, chunking, progress, colsum: bool | None, named: bool):
        """Read the document in chunks and store them as read: in a float16 working cache (store_types), with one
        more sequence to load the stored chunks through per question. A read estimated at doc_formats.READ_NOTICE_S
        or longer is announced first, on stderr (Conversation._announce: at the speed the last bounded read of this
        model measured here, else at that of its first tokens prefilled now in the spare sequence); its measured
        speed is recorded for the next estimate. `colsum` is the exact form's: a bounded store holds no column
        sums."""
        session = self.session
        working, chunk_type = store_types(self.cache_type)
        session.clear()
        session.use_cache_type(working)   # frees the context when the type changes
        n_seq = max(2, self.seq + 2)    # and one to load the stored chunks through, per question
        if session.ctx is None:
            session.create_context(chunking.n_ctx, n_seq)
        else:
            session.resize_context(chunking.n_ctx, n_seq)
        key = self._announce("bounded", f"reading it in chunks of {chunking.chunk}", self.seq + 1)
        t0 = time.perf_counter()
        self.store = ChunkedStore.read(session, self.prefix_tokens, cfg, chunking.chunk, cap=chunking.cap,
                                       seq=self.seq, spare=self.seq + 1, path=self.store_path, keep=named,
                                       chunk_type=chunk_type,
                                       progress=progress, notify=self._say,
                                       meta={"document": self.document, "system": self.system})
        doc_formats.record_read_speed(key, len(self.store.tokens) - self.store.resumed_tokens,
                                      time.perf_counter() - t0)
        return CompressReport(self.policy, self.budget, len(self.prefix_tokens), self.store.read_s,
                              params=cfg.params, chunk=chunking.chunk, cap=chunking.cap)

    def _held_cells(self, n_prompt: int) -> int:
        return self.store.held_cells(n_prompt)

    def _reselect(self, prompt: list[int], cfg):
        return self.store.reselect(self.session, prompt, cfg, seq=self.seq, extend=self.store_turns,
                                   window_from=self.window_from)

    @classmethod
    def open_store(cls, path, *, compression=None, model: str | None = None, seq: int = 0,
                   n_threads: int | None = None, cache_type: str | None = None):
        """A conversation over a bounded store folder (kvcli chat --store DIR, kvcli compress --store -o DIR, /save DIR
        of a bounded chat): its chunks are streamed for every question as in the chat that read the document
        (kvcli/drivers/reselect_bounded.py); the document is not read again. Refused in one line when the folder is
        not a whole store of this model (ChunkedStore.open) or the policy cannot be re-selected in bounded chunks (a
        column-sum policy, no budget). `compression`: the command's, as Reselected.from_store takes it (its model is
        the one opened, unless `model` is given; None: `full`, refused)."""
        t0 = time.perf_counter()
        path = Path(path).expanduser()
        m = read_manifest(path)
        policy, budget = (compression.policy, compression.budget) if compression is not None else ("full", None)
        if compression is not None:
            model = model or compression.model_path
        if policy == "full" or budget is None:
            raise KvcliError(f"{path} is a bounded store (the document in chunks, re-selected per question): give a "
                             "compressing --policy P and --budget N")
        model_path = model_for(m["model"]["path"], model)
        stored_type = m.get("chunk_type", m["cache_type"])   # q8_0 chunk files are read in a float16 cache
        if cache_type is not None and cache_type != stored_type:
            raise KvcliError(f"{path} holds a {stored_type} cache: drop --cache-type")
        store = ChunkedStore.open(path, model_path, manifest=m)   # the model's hash, then every chunk file
        t1 = time.perf_counter()
        session = open_native(model_path, n_ctx=0, cache_type=m["cache_type"], flash_attn=m["flash_attn"],
                              n_threads=n_threads)
        try:
            conv = cls(session, store.meta["document"], compression=compression, system=store.meta.get("system"),
                       seq=seq, reselect=True, cache_type=stored_type)
            if common_prefix(conv.prefix_tokens, store.tokens) < store.split:
                raise KvcliError(f"{path}: the stored prompt does not match this model's template and tokenizer")
            cfg = conv._cfg(None)   # the command's compression
            check_usable(session, cfg)
            store.cap = budget + store.chunk
            conv.store = store
            # as the chat that read it: the kept entries, a chunk, and TURN_ROOM; one more sequence to load through
            session.create_context(min(session.n_ctx_train, pad_cells(store.cap + TURN_ROOM)),
                                   max(2, seq + 2))
        except BaseException:
            session.close()
            raise
        conv.model_s = time.perf_counter() - t1
        conv.turns = [Turn(**t) for t in store.meta.get("turns", [])]
        conv.report = CompressReport(policy, budget, len(conv.prefix_tokens), 0.0, params=cfg.params,
                                     chunk=store.chunk, cap=store.cap)
        conv.load_s = t1 - t0
        return conv
