"""NativeSession: one model + one llama.cpp context, driven token by token.

kvcli drives `llama_decode` itself with its own batches and its own position counter per
sequence, because after a compaction a sequence holds fewer cells than its next position
(llama-cpp-python's high-level `Llama` class assumes they are equal). The session API is
the one of docs/internals.md, shared with the reference engine.
"""
from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvcli.errors import ContextFull, KvcliError
from kvcli.models import ModelInfo, longrope, read_model_info
from kvcli.native import cache, load_llama_cpp, signals_deferred
from kvcli.native.lib import ATTN_PATHS, CPU_UBATCH, MOVES_PATHS, attn_path, lib
from kvcli.native.saving import SavingMixin, SeqSnapshot  # noqa: F401  (re-exported: kvcli.engines, tests)
from kvcli.native.threads import default_threads
from kvcli.planning.formats import CAPTURED, observed_windows
from kvcli.planning.rope import rope_of
from kvcli.templating import gguf_special_token_ids, render_chat

CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


@dataclass
class SeqState:
    next_pos: int = 0           # position the next token of this sequence gets
    cells: int = 0              # cells the sequence occupies (fewer than next_pos once compressed)
    logits_index: int = -1      # batch row of this sequence's last logits; -1: none valid
    last_logits: np.ndarray | None = None  # copied right after the decode: llama.cpp's buffer is per batch
    prompt_tokens: int = 0
    kept_positions: list | None = None   # per (layer, kv head) original positions, once compressed
    reindexed: int = 0          # positions given back by re-indexing applies
    shared: int = 0             # of `cells`, those another sequence holds too (`share`): counted once, under it
    timings: dict = field(default_factory=dict)

    @property
    def tokens_read(self) -> int:
        """Every token decoded into the sequence, those whose positions re-indexing gave back included."""
        return self.next_pos + self.reindexed


class NativeSession(SavingMixin):
    engine = "native"

    def __init__(self, model_path, *, n_ctx: int | None = None, n_seq: int = 1, flash_attn: bool = True,
                 cache_type: str = "f16", n_batch: int | None = None, n_threads: int | None = None,
                 n_gpu_layers: int | None = None):
        """n_gpu_layers: layers (and their KV cache) offloaded to a GPU, where the library was built with one; None is
        llama.cpp's default (every layer), 0 keeps all on the CPU. n_batch None: CPU_UBATCH on a CPU, else 512."""
        self.L = load_llama_cpp()
        L = self.L
        self.cache_on_cpu = not L.llama_supports_gpu_offload() or n_gpu_layers == 0
        if n_batch is None:
            n_batch = CPU_UBATCH if self.cache_on_cpu else 512
        self.model_path = str(model_path)
        self.info: ModelInfo = read_model_info(model_path)
        self.longrope = longrope(model_path)    # phi3's LongRoPE pair: the context's size picks the factors
        if cache_type not in CACHE_TYPES:
            raise KvcliError(f"unknown cache type '{cache_type}': choose from {', '.join(CACHE_TYPES)}")
        if cache_type.startswith("q") and not flash_attn:
            raise KvcliError("a quantised V cache needs flash attention (llama.cpp's rule)")
        self.cache_type = cache_type
        self.flash_attn = flash_attn
        # attention path of compacted layers (and why): checks $KVCLI_ATTN_PATH before any model is loaded
        self.attn_path = attn_path(flash_attn, cache_on_cpu=self.cache_on_cpu)
        if os.environ.get("KVCLI_LAYOUT", "") not in ("", "ragged", "cells"):   # native/src/kvcli_layout.cpp
            raise KvcliError(f"KVCLI_LAYOUT must be ragged or cells (got {os.environ['KVCLI_LAYOUT']!r})")
        mparams = L.llama_model_default_params()
        if n_gpu_layers is not None:
            mparams.n_gpu_layers = int(n_gpu_layers)
        with signals_deferred():   # its log goes through a Python callback (kvcli/native/__init__.py)
            self.model = L.llama_model_load_from_file(self.model_path.encode(), mparams)
        if not self.model:
            raise KvcliError(f"llama.cpp could not load {self.model_path} (set KVCLI_DEBUG=1 to see its log)")
        layers = cache.model_kv_layers(self.model, self.info.n_layer_model)
        if layers != self.info.kv_layers:
            L.llama_model_free(self.model)
            self.model = None
            raise KvcliError(f"llama.cpp keeps layers {list(layers)} of {Path(self.model_path).name} in the cache "
                             f"kvcli compresses, kvcli expected {list(self.info.kv_layers)}")
        self.vocab = L.llama_model_get_vocab(self.model)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(self.model)
        self.ctx = None
        self.n_ctx = 0              # cells of the context, once create_context made it
        self._batch = None
        self.seqs: dict[int, SeqState] = {}
        self._ctx_opts = dict(n_seq=n_seq, n_batch=n_batch, n_threads=n_threads)
        self._owns_model = True
        if n_ctx != 0:  # 0: the caller tokenises first, then calls create_context with the size it needs
            self.create_context(n_ctx)

    def sibling(self, n_ctx: int, n_seq: int = 1) -> NativeSession:
        """A second session on this session's loaded model (no second copy of the weights) with a context and
        KV cache of its own, e.g. to read a document apart from the sequences decoding here and move it over
        with save_seq / restore_seq. Closing it keeps the model; close it before this one."""
        s = object.__new__(NativeSession)
        s.__dict__.update({k: v for k, v in self.__dict__.items()
                           if k in ("L", "model_path", "info", "longrope", "cache_type", "flash_attn", "attn_path",
                                    "model", "vocab", "n_vocab", "n_ctx_train", "cache_on_cpu")})
        s.ctx, s._batch, s.seqs, s._owns_model = None, None, {}, False
        s._ctx_opts = dict(self._ctx_opts, n_seq=n_seq)
        s.create_context(n_ctx)
        return s

    def create_context(self, n_ctx: int | None = None, n_seq: int | None = None) -> None:
        """Allocate the llama.cpp context (and its KV cache of n_ctx cells; default: the training context), for
        `n_seq` sequences (default: as the session was made)."""
        if n_seq is not None:
            self._ctx_opts["n_seq"] = int(n_seq)
        L = self.L
        n_seq, n_batch, n_threads = (self._ctx_opts[k] for k in ("n_seq", "n_batch", "n_threads"))
        flash_attn, cache_type = self.flash_attn, self.cache_type
        n_ctx = int(n_ctx or self.n_ctx_train)
        cparams = L.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq
        cparams.kv_unified = True  # one cell pool for all sequences: compressed ones free cells for others
        # sliding-window layers: a window cache of window + batch cells (llama.cpp's default is one of n_ctx cells)
        cparams.swa_full = not self.info.sliding_layers
        cparams.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else L.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.type_k = CACHE_TYPES[cache_type]
        cparams.type_v = CACHE_TYPES[cache_type]
        threads = n_threads or default_threads()
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        with signals_deferred():
            self.ctx = L.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            if self._owns_model:
                L.llama_model_free(self.model)
            self.model = None
            raise KvcliError(f"llama.cpp could not create a context of {n_ctx} tokens")
        self.n_ctx = L.llama_n_ctx(self.ctx)
        self.n_batch = n_batch
        self.n_seq = n_seq
        self.mem = L.llama_get_memory(self.ctx)
        self._batch = L.llama_batch_init(max(n_batch, n_seq), 0, n_seq)

    def resize_context(self, n_ctx: int, n_seq: int | None = None) -> None:
        """Reallocate the context (and its KV buffer) for `n_ctx` cells (and `n_seq` sequences: by default as
        many as now), keeping every sequence: each is saved
        (save_seq), the old context freed before the new one is allocated, and each restored. After a
        compression this gives back the cells a long-lived session no longer needs (the buffer was sized for
        the whole document). The sequences must fit: their cells are checked before anything is freed."""
        n_ctx = int(n_ctx)
        held = {s: st for s, st in self.seqs.items() if st.cells > 0}
        if n_seq is not None and any(s >= n_seq for s in held):
            raise KvcliError(f"cannot resize the context to {n_seq} sequences: sequence {max(held)} holds cells")
        if self.longrope and held:
            n_ctx = self._same_rope(n_ctx)
        if n_ctx == self.n_ctx and n_seq in (None, self.n_seq):
            return
        need = sum(self.measured_cells(s) for s in held)
        if need > n_ctx:
            raise KvcliError(f"cannot resize the context to {n_ctx} cells: its sequences hold {need}")
        snaps = {s: (self.save_seq(s), dict(st.timings)) for s, st in held.items()}
        self._free_context()
        self.seqs.clear()
        self.create_context(n_ctx, n_seq)
        for s, (snap, timings) in snaps.items():
            self.restore_seq(snap, s)
            self.seqs[s].timings = timings

    def _same_rope(self, n_ctx: int) -> int:
        """A LongRoPE model's cached K rows are rotated with the factors of the context they were decoded in:
        a context that keeps them must use the same ones. Shrinking a long-factor context stops at the smallest
        long one; growing a short-factor one past the original context cannot keep them."""
        lr = self.longrope
        if lr.regime(n_ctx) == self.rope_regime:
            return n_ctx
        if self.rope_regime == "long":
            return max(n_ctx, lr.long_ctx())
        raise KvcliError(f"{Path(self.model_path).name}: LongRoPE model: a context of {n_ctx} cells would rotate "
                         f"with the long RoPE factors, the cached entries were rotated with the short ones (a "
                         f"context of at most {lr.n_ctx_orig} cells)")

    @property
    def rope_regime(self) -> str | None:
        """A LongRoPE model's factors in this context ("short" or "long"), else None."""
        return self.longrope.regime(self.n_ctx) if self.longrope and self.n_ctx else None

    @property
    def n_threads(self) -> int | None:
        """The threads asked for; None: default_threads() picks them at each create_context."""
        return self._ctx_opts["n_threads"]

    # ------------------------------------------------------------------ lifecycle
    def use_cache_type(self, cache_type: str) -> None:
        """Hold K/V as `cache_type` from the next create_context on (the context is freed when the type changes;
        no sequence may hold cells then): a bounded store reads and re-selects in float16 whatever its chunk files
        hold (kvcli/drivers/reselect_bounded.py, store_types)."""
        if cache_type not in CACHE_TYPES:
            raise KvcliError(f"unknown cache type '{cache_type}': choose from {', '.join(CACHE_TYPES)}")
        if cache_type == self.cache_type:
            return
        if cache_type.startswith("q") and not self.flash_attn:
            raise KvcliError("a quantised V cache needs flash attention (llama.cpp's rule)")
        if any(st.cells > 0 for st in self.seqs.values()):
            raise KvcliError(f"cannot change the cache type to {cache_type}: a sequence holds cells")
        self._free_context()
        self.seqs.clear()
        self.n_ctx = 0
        self.cache_type = cache_type

    def _free_context(self) -> None:
        L = self.L
        if getattr(self, "_batch", None) is not None:
            L.llama_batch_free(self._batch)
            self._batch = None
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None
            self.mem = None

    def close(self) -> None:
        L = self.L
        self._free_context()
        if getattr(self, "model", None) and getattr(self, "_owns_model", True):
            L.llama_model_free(self.model)
        self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------------ text
    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (ctypes.c_int32 * cap)()
        n = self.L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, True)
        if n < 0:
            cap = -n
            buf = (ctypes.c_int32 * cap)()
            n = self.L.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, True)
        if n < 0:
            raise KvcliError("tokenisation failed")
        return list(buf[:n])

    def token_bytes(self, token: int) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = self.L.llama_token_to_piece(self.vocab, token, buf, 64, 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = self.L.llama_token_to_piece(self.vocab, token, buf, -n, 0, False)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(self.L.llama_vocab_is_eog(self.vocab, token))

    def chat_template(self) -> str | None:
        t = self.L.llama_model_chat_template(self.model, None)
        return t.decode("utf-8") if t else None

    def special_tokens(self) -> dict:
        """Text of the GGUF's bos/eos/unk/pad tokens, the variables a chat template may use."""
        n_vocab = self.L.llama_vocab_n_tokens(self.vocab)
        out = {}
        for name, tid in gguf_special_token_ids(self.model_path).items():
            if 0 <= tid < n_vocab:
                t = self.L.llama_vocab_get_text(self.vocab, tid)
                out[name] = t.decode("utf-8", "replace") if t else ""
        return out

    def apply_chat_template(self, messages: list[dict], add_assistant: bool = True) -> str:
        """The GGUF's jinja chat template rendered by kvcli.templating, as the reference engine does
        (llama.cpp's built-in formats would drop parts of some templates, e.g. SmolLM2's system turn)."""
        return render_chat(self.chat_template(), messages, add_generation_prompt=add_assistant,
                           special_tokens=self.special_tokens(), model=self.info.path.name)

    # ------------------------------------------------------------------ decoding
    def seq(self, seq: int = 0) -> SeqState:
        if not 0 <= seq < self.n_seq:
            raise KvcliError(f"sequence {seq} out of range (this context holds {self.n_seq})")
        return self.seqs.setdefault(seq, SeqState())

    def cells_used(self) -> int:
        """Cells held by any sequence, a cell shared by several (`share`) counted once: measured from the cache
        while any sequence shares cells (whose sharer is freed first decides where they count)."""
        if any(s.shared for s in self.seqs.values()):
            return self.measured_cells(-1)
        return sum(s.cells for s in self.seqs.values())

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> dict[int, int]:
        """Decode one batch of (token, pos, seq, want_logits); return seq -> logits row."""
        b = self._batch
        rows = {}
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
            if logits:
                rows[seq] = i
        b.n_tokens = len(entries)
        rc = self.L.llama_decode(self.ctx, b)
        if rc == 1:
            raise ContextFull(f"the context is full ({self.n_ctx} cells)")
        if rc != 0:
            raise KvcliError(f"llama_decode failed with code {rc}")
        # llama.cpp's logits buffer only describes the last batch: copy each sequence's row now, so a
        # later decode of another sequence cannot leave this one pointing at a stale or NULL row
        for s_id, row in rows.items():
            ptr = self.L.llama_get_logits_ith(self.ctx, row)
            if not ptr:
                raise KvcliError(f"llama.cpp returned no logits for sequence {s_id}")
            self.seq(s_id).last_logits = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()
        return rows

    def prefill(self, tokens: list[int], seq: int = 0, observe=(), window=0, progress=None):
        """Append tokens to `seq`. With `observe`, capture the Observation (see docs/internals.md); with
        "window", `window` is one window length or several (one window sum each)."""
        st = self.seq(seq)
        if not tokens:
            return None
        if self.cells_used() + len(tokens) > self.n_ctx:
            raise ContextFull(f"{len(tokens)} more tokens do not fit: {self.cells_used()} of {self.n_ctx} "
                              "cells are in use")
        observe = tuple(observe)
        windows = observed_windows(observe, window, len(tokens))
        t0 = time.perf_counter()
        cuts = _batch_cuts(len(tokens), self.n_batch, max(windows, default=0))
        if self.cache_on_cpu:   # the probabilities the cut bounds are host memory; a GPU's would only cost passes
            cuts = _few_rows_cuts(cuts, few_rows_cap(self.cells_used() + len(tokens), self.info.n_head))
        armed = bool(CAPTURED.intersection(observe))
        if armed:
            cache.observe_begin(self.ctx, seq, observe,
                                window_pos0=[st.next_pos + len(tokens) - w for w in windows])
        try:
            start = 0
            for end in cuts:
                self._append([(tokens[i], st.next_pos + (i - start), seq, i == len(tokens) - 1)
                              for i in range(start, end)])
                if end - start > 1:
                    # the ubatch's scratch pages given back (kvcli_release_compute): the next ubatch's graph, of
                    # another shape, would lay its tensors over other pages, and the prefill would hold the union
                    cache.release_compute(self.ctx)
                if progress is not None:
                    progress(end - start)
                start = end
        finally:
            if armed:
                cache.observe_end(self.ctx)
        st.prompt_tokens += len(tokens)
        st.timings["prefill_s"] = st.timings.get("prefill_s", 0.0) + time.perf_counter() - t0
        if not observe:
            return None
        obs = cache.read_observation(self.ctx, seq, self.info, observe, windows if "window" in observe else ())
        if "query" in observe:
            obs.rope = rope_of(self.info)
        return obs

    def step(self, tokens: dict[int, int]) -> None:
        """Decode one token for each listed sequence, all in one batch."""
        if self.cells_used() + len(tokens) > self.n_ctx:
            raise ContextFull(f"the context is full ({self.n_ctx} cells)")
        self._append([(tok, self.seq(s).next_pos, s, True) for s, tok in tokens.items()])

    def _append(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode one batch and advance the bookkeeping of its sequences, all or nothing. Ctrl-C's
        KeyboardInterrupt is raised at the first bytecode after llama_decode returns, i.e. after the cells are
        in the cache but before next_pos counts them; any exception before the bookkeeping is complete
        therefore removes the batch's cells again (positions >= the old next_pos), so the cache and its
        bookkeeping never disagree by a token."""
        if self.longrope:   # llama.cpp picks the factors by cells, whatever the positions (LongRope)
            self.longrope.check_position(Path(self.model_path).name, self.n_ctx, max(p for _, p, _, _ in entries))
        saved = {}
        for _, _, s, _ in entries:
            st = self.seq(s)
            saved.setdefault(s, (st.next_pos, st.cells, st.logits_index, st.last_logits))
        try:
            rows = self._decode(entries)
            for _, _, s, _ in entries:
                st = self.seqs[s]
                st.next_pos += 1
                st.cells += 1
                if s in rows:
                    st.logits_index = rows[s]
        except BaseException:
            for s, (next_pos, cells, logits_index, last_logits) in saved.items():
                self.L.llama_memory_seq_rm(self.mem, s, next_pos, -1)
                st = self.seqs[s]
                st.next_pos, st.cells, st.logits_index, st.last_logits = next_pos, cells, logits_index, last_logits
            raise

    def logits(self, seq: int = 0) -> np.ndarray:
        st = self.seq(seq)
        if st.logits_index < 0 or st.last_logits is None:
            raise KvcliError("no logits yet: decode something first")
        return st.last_logits.copy()

    def clear(self, seq: int | None = None) -> None:
        """Forget one sequence (or all) and free its cells."""
        if getattr(self, "ctx", None) is None:   # no context (yet, or freed by use_cache_type): nothing is held
            self.seqs.clear() if seq is None else self.seqs.pop(seq, None)
            return
        if seq is None:
            self.L.llama_memory_clear(self.mem, True)
            self.seqs.clear()
            return
        self.L.llama_memory_seq_rm(self.mem, seq, -1, -1)
        self.seqs.pop(seq, None)

    def pack_cells(self) -> int:
        """Several compressed sequences in this context: reorder the cache's cells so that every sequence's dead
        slots lead, each layer then storing only its live entries (native/src/kvcli_layout.cpp, `pack`); each
        sequence keeps its cells' order, so nothing it decodes or plans from changes. Returns the cells moved."""
        return cache.layout_pack(self.ctx)

    # ------------------------------------------------------------------ compression
    def apply_plan(self, plan, seq: int = 0, reindex: bool = False) -> None:
        """Compact `seq` (compressed already or not: slots are its cells now). reindex=True: the kept
        entries of every (layer, KV head) get positions B-k..B-1, right-aligned in the B = plan.max_kept
        cells (K re-rotated), decoding continues at B, and kept_positions() reports those new positions."""
        st = self.seq(seq)
        origins = self._slot_origins(seq)
        try:
            cache.apply_plan(self.ctx, seq, plan, self.info.head_dim, reindex_p0=0 if reindex else None)
        except KvcliError:
            if self.measured_cells(seq) == 0 and st.cells > 0:  # a failed re-rotation removes the sequence
                self.seqs.pop(seq, None)
            raise
        if reindex:
            B = plan.max_kept   # right-aligned: positions equal the slots Plan.first_slot gives
            st.kept_positions = [[np.arange(plan.first_slot(l, h, reindexed=True), B, dtype=np.int32)
                                  for h in range(plan.n_head_kv)] for l in range(plan.n_layer)]
            st.reindexed += st.next_pos - plan.max_kept
            st.next_pos = plan.max_kept  # the last logits stay: they are the model's output for the last token
        else:
            st.kept_positions = [[origins[l][h][k] for h, k in enumerate(layer)]
                                 for l, layer in enumerate(plan.kept_lists())]
        st.cells = plan.max_kept

    def share(self, src: int, dst: int, upto: int) -> None:
        """Make the empty sequence `dst` start with `src`'s entries of positions 0..upto-1 without copying them
        (llama_memory_seq_cp in one cell pool: the cells get a second sequence id); `dst` continues at `upto`.
        A resident document's cells are shared so by every question about it (kvcli/drivers/resident.py)."""
        st_src = self.seq(src)
        if dst == src or self.seq(dst).cells:
            raise KvcliError(f"sequence {dst} is not an empty sequence to share sequence {src} into")
        if not 0 <= upto <= st_src.next_pos or st_src.cells != st_src.next_pos:
            raise KvcliError(f"cannot share positions 0..{upto - 1} of sequence {src} "
                             f"({st_src.cells} cells, next position {st_src.next_pos}: an uncompressed one is shared)")
        if upto:   # nothing shared: `dst` starts empty, at position 0
            self.L.llama_memory_seq_cp(self.mem, src, dst, 0, upto)
        st = self.seq(dst)
        st.next_pos = st.cells = st.shared = st.prompt_tokens = upto
        st.logits_index, st.last_logits, st.kept_positions, st.reindexed = -1, None, None, 0

    def gather(self, plan, src: int, dst: int) -> None:
        """`dst` (empty) gets the entries `plan` keeps of `src`, as `apply_plan(plan, src)` would leave them, in
        cells of its own; `src` keeps every cell it had (kvcli_gather_plan). `dst` continues where `src` does,
        with its logits."""
        st_src = self.seq(src)
        if dst == src or self.seq(dst).cells:
            raise KvcliError(f"sequence {dst} is not an empty sequence to gather sequence {src} into")
        origins = self._slot_origins(src)
        cache.gather_plan(self.ctx, src, dst, plan, self.info.head_dim)
        st = self.seq(dst)
        st.next_pos, st.cells, st.shared = st_src.next_pos, plan.max_kept, 0
        st.prompt_tokens, st.reindexed = st_src.prompt_tokens, st_src.reindexed
        st.kept_positions = [[origins[l][h][k] for h, k in enumerate(layer)]
                             for l, layer in enumerate(plan.kept_lists())]
        st.last_logits = None if st_src.last_logits is None else st_src.last_logits.copy()
        st.logits_index = 0 if st.last_logits is not None else -1

    def free_seq(self, *exclude: int) -> int:
        """A sequence id of this context that holds nothing (and is not among `exclude`)."""
        for q in range(self.n_seq):
            if q not in exclude and not self.seq(q).cells:
                return q
        raise KvcliError(f"every one of the context's {self.n_seq} sequences is in use")

    def move_seq(self, src: int, dst: int) -> None:
        """Hand `src`'s cells and bookkeeping to the empty sequence `dst` (seq_cp, then `src` dropped)."""
        if dst == src or self.seq(dst).cells:
            raise KvcliError(f"sequence {dst} is not an empty sequence to move sequence {src} into")
        self.L.llama_memory_seq_cp(self.mem, src, dst, -1, -1)
        self.seqs[dst] = self.seqs.pop(src, SeqState())
        self.L.llama_memory_seq_rm(self.mem, src, -1, -1)

    def _slot_origins(self, seq: int) -> list[list[np.ndarray]]:
        """Per (layer, KV head), the original position of the entry in each slot (cell order) of `seq`,
        -1 for a dead slot (bias -inf). Cells of the compacted block (the sequence's lowest B positions
        after a compaction) map to the kept lists; cells appended since hold their own position."""
        st = self.seq(seq)
        pos = cache.seq_positions(self.ctx, seq)
        prev = st.kept_positions
        if prev is None or pos.size == 0:
            return [[pos] * self.info.n_head_kv for _ in range(self.info.n_layer)]
        width = max(len(h) for layer in prev for h in layer)
        j = pos - pos.min()
        block = j < width
        out = []
        for layer in prev:
            row = []
            for kept in layer:
                a = pos.copy()
                k = np.asarray(kept, np.int32)
                idx = np.flatnonzero(block)
                live = j[idx] < k.size
                a[idx] = -1
                a[idx[live]] = k[j[idx[live]]]
                row.append(a)
            out.append(row)
        return out

    def kept_positions(self, seq: int = 0) -> list[list[np.ndarray]]:
        st = self.seq(seq)
        if st.kept_positions is None:
            full = np.arange(st.cells, dtype=np.int32)
            return [[full] * self.info.n_head_kv for _ in range(self.info.n_layer)]
        return st.kept_positions

    # ------------------------------------------------------------------ stats
    def bytes_per_cell(self) -> int:
        """K + V bytes one uncompressed cell takes over all layers at this cache type."""
        return self.info.cell_bytes(self.cache_type)

    def stats(self, seq: int = 0) -> dict:
        """Cache figures measured from the live cache (kvcli_stats_get), plus timings."""
        st = self.seq(seq)
        i = self.info
        live = cache.stats(self.ctx, seq, i.n_layer_model, i.n_head_kv)
        mem = cache.memory(self.ctx)
        kv_held = live["k_bytes"] + live["v_bytes"]
        sliding = {}
        if i.sliding_layers:
            # llama.cpp's window cache of the sliding layers, which kvcli leaves whole: at least the window, more
            # until it needs room (it reuses the cells of the lowest positions first), so its cells of `seq` hold
            # consecutive positions and are counted from them
            p0, p1 = self.L.llama_memory_seq_pos_min(self.mem, seq), self.L.llama_memory_seq_pos_max(self.mem, seq)
            swa_cells = p1 - p0 + 1 if p0 >= 0 else 0
            for il in i.sliding_layers:
                live["per_layer_cells"][il] = swa_cells
                live["per_head_entries"][il] = [swa_cells] * i.n_head_kv
            sliding = {"sliding_layers": list(i.sliding_layers), "sliding_window": i.sliding_window,
                       "sliding_cells": swa_cells,
                       "sliding_bytes": swa_cells * i.sliding_cell_bytes(self.cache_type)}
        return {
            "kv_cells": live["n_cells"],
            "kv_bytes": kv_held + live["bias_bytes"],
            "kv_bytes_full": self.bytes_per_cell() * st.tokens_read,  # every token seen
            # the K/V bytes of the live entries alone: a (layer, KV head, cell) that is not dead. kv_bytes holds
            # each layer's rows from its front on (the ragged layout, native/src/kvcli_layout.cpp): the live
            # entries plus the dead slots of a layer whose KV heads keep different counts, or that sit past a
            # live one (another sequence's block, KVCLI_LAYOUT=cells)
            "kv_bytes_live": self.bytes_per_cell() * live["live_entries"] // (i.n_layer * i.n_head_kv),
            # what the context's KV cache allocated (all sequences, whatever they hold): K/V + slot-bias buffers
            "kv_bytes_allocated": mem["kv_bytes"] + mem["bias_bytes"],
            "kv_cells_allocated": mem["kv_size"],
            # per model layer, cells live in at least one KV head of the layer (cells are shared by the layers of
            # a cache); a sliding layer (sliding_layers) counts the cells of llama.cpp's window cache
            "per_layer_cells": live["per_layer_cells"],
            # live entries of each (model layer, KV head): a plan's n_kept, plus the tokens decoded since
            "per_head_entries": live["per_head_entries"],
            # models with sliding-window layers: kv_cells, kv_bytes(_full) and the plans cover the global layers
            # only; the sliding layers' window cache holds sliding_cells cells of sliding_bytes
            **sliding,
            **{k: round(v, 4) for k, v in st.timings.items()},
        }

    def attn_paths_taken(self) -> list[str | None]:
        """Per layer, the attention path ("split" or "mask") of the last graph built while a sequence was
        compacted; None for a layer no such graph was built for yet."""
        L = lib()
        return [ATTN_PATHS.get(L.check(L.kvcli_attn_path_taken(self.ctx, il), "kvcli_attn_path_taken"))
                for il in cache.kv_layer_ids(self.info)]

    def compact_path_taken(self) -> str | None:
        """How the last compaction moved the kept K/V rows: "device" (a get_rows / set_rows graph on the cache's
        backend) or "host" (through host memory); None before the first ($KVCLI_COMPACT, native/src/README.md)."""
        L = lib()
        return MOVES_PATHS.get(L.check(L.kvcli_compact_path_taken(self.ctx), "kvcli_compact_path_taken"))


# The attention scratch of a call of few rows: on the CPU a call of at most KVCLI_FEW_ROWS_MAX rows attends by matrix
# products (native/src/kvcli_attention.cpp, rows_attention; its observed window rows too), whose [n_kv, rows, n_head]
# F32 probabilities are made whole, a group of KV heads at a time; flash attention, which makes none, takes the larger
# calls. A question over a resident 16k-token document made 36 MiB of them at 25 rows. Such a call is cut into calls
# of at most few_rows_cap(n_kv, n_head) rows, whose probabilities make at most FEW_ROWS_SCRATCH by their shape, for
# one more pass over the weights and the cells per call (native/src/README.md, "Memory: what a question adds"). 16 MiB
# since every layer is built by groups and the softmax is made in place (2026-12-05): a 16k question's call then
# touches about half that, and its 15-18 rows go in one call (qwen2.5-0.5b: 0.73 against 0.80 s, +36 against +29 MiB
# at 16k in process; 42.9 MiB in two calls before).
FEW_ROWS_SCRATCH = 16 << 20
FEW_ROWS_MAX = 63   # KVCLI_FEW_ROWS_MAX (native/src/kvcli_observation.h)


def few_rows_cap(n_kv: int, n_head: int) -> int:
    """The most rows a few-rows call over n_kv cells may have to make at most FEW_ROWS_SCRATCH; at least 8, as each
    call passes over the weights and the cells once more (at 16k cells 8 calls of 4 rows took 1.8-2.5 s where 4 of
    8 took 1.4)."""
    return max(8, min(FEW_ROWS_MAX, FEW_ROWS_SCRATCH // max(1, n_kv * n_head * 4)))


def _few_rows_cuts(cuts: list[int], cap: int) -> list[int]:
    """`cuts` with every call of at most FEW_ROWS_MAX rows cut into near-equal calls of at most `cap` rows."""
    out, start = [], 0
    for end in cuts:
        n = end - start
        if cap < n <= FEW_ROWS_MAX:
            parts = -(-n // cap)
            out += [start + (n * i) // parts for i in range(1, parts)]
        out.append(end)
        start = end
    return out


def _batch_cuts(n: int, n_batch: int, window: int) -> list[int]:
    """End offsets of the llama_decode calls for n tokens: at most n_batch each, and the last
    `window` tokens (the observation window) in a call of their own."""
    window = max(0, min(window, n))
    head = n - window
    cuts = list(range(n_batch, head, n_batch)) + ([head] if head else [])
    cuts += list(range(head + n_batch, n, n_batch)) + [n] if window else []
    return cuts if cuts else [n]
