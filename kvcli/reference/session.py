"""ReferenceSession: the session API of docs/internals.md on a transformers model (float32, CPU).

It loads the very GGUF file the native engine loads, prefills with the kvcli attention
(kvcli/reference/attention.py), captures the same Observation the native engine captures,
applies plans to its cache (kvcli/reference/compact.py) in the native cache's slot layout, and
decodes at the original positions: after a compaction the next token still gets position n (the
uncompressed length), exactly as in the native engine. A compaction with `reindex=True` instead
gives the kept entries the positions B-k..B-1 (right-aligned; K re-rotated in torch) and decoding continues at B,
the widest head's count, again as the native engine does. A compressed sequence can be observed
and compacted again (chunked prefill). One sequence is processed at a time; clarity beats speed.

A model with sliding-window layers (gemma3) is run as the native engine runs it: observations, plans,
compaction and the sequence's cells cover its global layers (ModelInfo.kv_layers; the plan's layer l is model
layer kv_layers[l]); the sliding layers are never observed nor compacted and attend over their window
(kvcli/reference/attention.py). Unlike llama.cpp's window cache, they keep every entry (the window is the
mask's), so any position can be rolled back to; re-indexing is refused, as natively (the window layers keep
their positions).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvcli.errors import ContextFull, KvcliError
from kvcli.models import ModelInfo, read_model_info
from kvcli.planning.formats import CAPTURED, Observation, Plan, check_kinds, observed_windows
from kvcli.planning.rope import rope_of
from kvcli.reference import compact
from kvcli.reference.attention import ForwardState, LayerSlots, Observer, active, hf_to_gguf_dims
from kvcli.reference.model import forward_cached, load, use_rope_context
from kvcli.templating import gguf_special_token_ids, render_chat

@dataclass
class RefSeq:
    cache: object                     # transformers DynamicCache
    slots: list                       # LayerSlots per model layer
    kv_layers: tuple                  # the model layers plans cover (ModelInfo.kv_layers)
    next_pos: int = 0                 # position of the next token (the uncompressed length, or B after reindexing)
    reindexed: int = 0                # positions re-indexing gave back
    last_logits: np.ndarray | None = None
    compressed: bool = False
    # the position llama.cpp's cell of each slot carries (Observation.positions): the token's own
    # position, n-B..n-1 after a compaction without re-indexing, 0..B-1 after one with it
    cell_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    # False once compacted without re-indexing: its entries' positions then differ per (layer, head)
    # from their slots' positions, and the native engine cannot re-index such a sequence either
    reindexable: bool = True
    prompt_tokens: int = 0
    timings: dict = field(default_factory=dict)

    @property
    def cells(self) -> int:
        """Cells the sequence occupies: every layer plans cover has the same slots (the native cache's layout)."""
        return max((self.slots[il].n_slots for il in self.kv_layers), default=0)

    @property
    def tokens_read(self) -> int:
        """Every token decoded into the sequence, those whose positions re-indexing gave back included."""
        return self.next_pos + self.reindexed


class ReferenceSession:
    engine = "reference"
    cache_type = None   # K/V held in float32 whatever was asked: no cache type to choose (use_cache_type)

    def __init__(self, model_path, *, n_ctx: int | None = None, n_seq: int = 1, n_threads: int | None = None,
                 **_ignored):
        self.model_path = str(model_path)
        self.info: ModelInfo = read_model_info(model_path)
        loaded = load(model_path)
        self._loaded = loaded
        self.model, self.tokenizer, self.eog_ids = loaded.model, loaded.tokenizer, loaded.eog_ids
        self.qk_permuted = loaded.qk_permuted
        cfg = self.model.config
        if (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) != \
                (self.info.n_layer_model, self.info.n_head, self.info.n_head_kv):
            raise KvcliError(f"transformers read other shapes from {self.model_path} than its GGUF header")
        self.n_vocab = int(cfg.vocab_size)
        self.n_ctx_train = self.info.n_ctx_train
        self.n_batch = 512          # only used for progress display by callers: prefill is one forward pass
        self.n_seq = n_seq
        self.n_threads = n_threads   # asked for; None: torch's own choice
        if n_threads:
            torch.set_num_threads(int(n_threads))
        self.ctx = None
        self.n_ctx = 0
        self.seqs: dict[int, RefSeq] = {}
        self._rotation = None     # compact.KeyRotation, made at the first re-indexing
        if n_ctx != 0:
            self.create_context(n_ctx)

    def create_context(self, n_ctx: int | None = None) -> None:
        """Fix the number of cells all sequences may hold together (default: the training context).
        The reference cache grows on demand; the limit only mirrors the native engine's."""
        self.n_ctx = int(n_ctx or self.n_ctx_train)
        self.ctx = self     # not None: "a context exists", as callers of the native session check

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self.seqs.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------------ text
    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token, control tokens rendered as nothing (llama.cpp's special=false)."""
        if token in self.tokenizer.all_special_ids:
            return b""
        return _piece_bytes(self.tokenizer.convert_ids_to_tokens(int(token)))

    def detokenize(self, tokens: list[int]) -> str:
        return b"".join(self.token_bytes(t) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return int(token) in self.eog_ids

    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)

    def special_tokens(self) -> dict:
        """Text of the GGUF's bos/eos/unk/pad tokens, the variables a chat template may use."""
        n_vocab = len(self.tokenizer)
        return {name: self.tokenizer.convert_ids_to_tokens(tid)
                for name, tid in gguf_special_token_ids(self.model_path).items() if 0 <= tid < n_vocab}

    def apply_chat_template(self, messages: list[dict], add_assistant: bool = True) -> str:
        """The GGUF's jinja chat template rendered by kvcli.templating, exactly as the native engine does."""
        return render_chat(self.chat_template(), messages, add_generation_prompt=add_assistant,
                           special_tokens=self.special_tokens(), model=self.info.path.name)

    # ------------------------------------------------------------------ sequences
    def seq(self, seq: int = 0) -> RefSeq:
        if not 0 <= seq < self.n_seq:
            raise KvcliError(f"sequence {seq} out of range (this session holds {self.n_seq})")
        if seq not in self.seqs:
            from transformers import DynamicCache  # noqa: PLC0415
            i = self.info
            # every layer keeps every entry (no config: transformers would make sliding layers drop the old ones)
            self.seqs[seq] = RefSeq(cache=DynamicCache(), kv_layers=i.kv_layers,
                                    slots=[LayerSlots.empty(i.n_head_kv, i.sliding_window if il in i.sliding_layers
                                                            else 0) for il in range(i.n_layer_model)])
        return self.seqs[seq]

    def cells_used(self) -> int:
        return sum(s.cells for s in self.seqs.values())

    def clear(self, seq: int | None = None) -> None:
        if seq is None:
            self.seqs.clear()
        else:
            self.seqs.pop(seq, None)

    def copy_seq(self, src: int, dst: int) -> None:
        """Make `dst` an independent copy of `src` (cache, slots, position, logits): llama.cpp's
        seq_cp, except that nothing is shared, so either copy can be compressed on its own."""
        if src == dst:
            raise KvcliError("copy_seq: source and destination are the same sequence")
        self.seq(dst)
        self.seqs[dst] = copy.deepcopy(self.seq(src))

    def save_seq(self, seq: int = 0) -> RefSeq:
        """A copy of `seq` to put back later with `restore_seq` (what NativeSession.save_seq gives as a state)."""
        return copy.deepcopy(self.seq(seq))

    def restore_seq(self, snap: RefSeq, seq: int = 0) -> int:
        """Replace `seq` by a copy of a saved one (its previous cells are dropped); returns the cells it occupies."""
        if self.cells_used() - self.seq(seq).cells + snap.cells > self.n_ctx:
            raise ContextFull(f"a {snap.cells}-cell sequence does not fit: {self.cells_used()} of {self.n_ctx} "
                              "cells are in use")
        self.seqs[seq] = copy.deepcopy(snap)
        return snap.cells

    def _check_room(self, n_new: int) -> None:
        if self.ctx is None:
            self.create_context(None)
        if self.cells_used() + n_new > self.n_ctx:
            raise ContextFull(f"{n_new} more tokens do not fit: {self.cells_used()} of {self.n_ctx} cells are in use")

    def _use_rope(self, max_pos: int) -> None:
        """A LongRoPE model's factors for this context, as the native engine's, with its guard (positions the short
        factors do not cover are refused)."""
        lr = self._loaded.longrope
        if lr is None:
            return
        lr.check_position(Path(self.model_path).name, self.n_ctx, max_pos)
        use_rope_context(self._loaded, self.n_ctx)

    def _forward(self, st: RefSeq, tokens: list[int], observer: Observer | None = None) -> None:
        """One forward pass of `tokens` at positions next_pos.. through the whole model."""
        pos = torch.arange(st.next_pos, st.next_pos + len(tokens), dtype=torch.int64)
        self._use_rope(st.next_pos + len(tokens) - 1)
        ids = torch.tensor([tokens], dtype=torch.int64)
        if ids.numel() and (ids.min() < 0 or ids.max() >= self.n_vocab):
            raise KvcliError(f"token id out of range [0, {self.n_vocab})")
        with torch.no_grad(), active(ForwardState(layers=st.slots, q_pos=pos, observer=observer)):
            out = forward_cached(self.model, ids, pos[None], st.cache)
        st.last_logits = out.logits[0, -1].to(torch.float32).numpy().copy()
        st.cell_pos = torch.cat([st.cell_pos, pos])
        st.next_pos += len(tokens)

    def prefill(self, tokens: list[int], seq: int = 0, observe=(), window: int = 0, progress=None):
        """Append tokens to `seq`; with `observe`, return the Observation of the whole sequence."""
        st = self.seq(seq)
        observe = check_kinds(observe)
        if not tokens:
            return None
        windows = observed_windows(observe, window, len(tokens))
        self._check_room(len(tokens))
        kinds = CAPTURED.intersection(observe)
        observer = Observer(self.info.kv_layers, kinds,
                            tuple(st.next_pos + len(tokens) - w for w in windows) if "window" in observe else (),
                            query_pos0=st.next_pos + len(tokens) - max(windows) if "query" in observe else None) \
            if kinds else None
        t0 = time.perf_counter()
        self._forward(st, tokens, observer)
        st.prompt_tokens += len(tokens)
        st.timings["prefill_s"] = st.timings.get("prefill_s", 0.0) + time.perf_counter() - t0
        if progress is not None:
            progress(len(tokens))
        return self._observation(st, observe, observer, windows) if observe else None

    def _observation(self, st: RefSeq, observe: tuple, observer: Observer | None, windows: tuple) -> Observation:
        i = self.info
        n = st.cells
        obs = Observation(n_layer=i.n_layer, n_head=i.n_head, n_head_kv=i.n_head_kv, head_dim=i.head_dim, n=n,
                          positions=st.cell_pos.to(torch.int32).numpy().copy())
        if "window" in observe:
            obs.window_sums = torch.stack([torch.stack(w) for w in observer.window]).to(torch.float32).numpy()
            obs.windows = windows
        if "colsum" in observe:
            obs.colsum = torch.stack(observer.colsum).to(torch.float32).numpy()
        if "colmax" in observe:
            obs.colmax = torch.stack(observer.colmax).to(torch.float32).numpy()
        if "query" in observe:   # Q in llama.cpp's dimension order, as the native engine reports it
            obs.queries = hf_to_gguf_dims(torch.stack(observer.queries), self.qk_permuted).to(torch.float32).numpy()
            obs.query_positions = np.asarray(observer.query_positions, np.int32)
            obs.rope = rope_of(i)
        if "kv" in observe:
            # K in llama.cpp's dimension order, as the native engine reports it (see hf_to_gguf_dims)
            layers = [st.cache.layers[il] for il in i.kv_layers]
            keys = torch.stack([layer.keys[0] for layer in layers])
            obs.keys = hf_to_gguf_dims(keys, self.qk_permuted).to(torch.float32).numpy()
            obs.values = torch.stack([layer.values[0] for layer in layers]).to(torch.float32).numpy()
        obs.validate()
        return obs

    def step(self, tokens: dict[int, int]) -> None:
        """Decode one token for each listed sequence (one after the other: clarity over speed)."""
        self._check_room(len(tokens))
        for s, tok in tokens.items():
            self._forward(self.seq(s), [int(tok)])

    def logits(self, seq: int = 0) -> np.ndarray:
        st = self.seq(seq)
        if st.last_logits is None:
            raise KvcliError("no logits yet: decode something first")
        return st.last_logits.copy()

    # ------------------------------------------------------------------ compression
    def apply_plan(self, plan: Plan, seq: int = 0, reindex: bool = False) -> None:
        """Compact `seq` as the plan says (it may be compressed already: biases compose). With `reindex`,
        the kept entries of every (layer, KV head) get the positions B-k..B-1, K rows re-rotated, and
        decoding continues at B = plan.max_kept (see kvcli/reference/compact.py)."""
        st = self.seq(seq)
        if reindex and not st.reindexable:
            raise KvcliError(f"sequence {seq} was compacted without re-indexing: its entries' positions differ per "
                             "layer and head from its cells' positions, so it cannot be re-indexed")
        if reindex and self.info.sliding_layers:
            # the sliding layers keep the original positions, which the next token must continue (as natively)
            raise KvcliError("re-indexing (a chunked read) is not supported for models with sliding-window layers")
        if (plan.n_layer, plan.n_head_kv) != (self.info.n_layer, self.info.n_head_kv):
            raise KvcliError(f"plan is for {plan.n_layer} layers x {plan.n_head_kv} KV heads, the model has "
                             f"{self.info.n_layer} x {self.info.n_head_kv}")
        try:
            plan.validate(st.cells, self.info.head_dim)
        except ValueError as e:
            raise KvcliError(str(e)) from None
        t0 = time.perf_counter()
        self._use_rope(st.next_pos - 1)
        if self._rotation is None and reindex:
            self._rotation = compact.KeyRotation(self.model)
        compact.apply_plan(st.cache, st.slots, plan, self._rotation if reindex else None, self.qk_permuted,
                           self.info.kv_layers)
        width = plan.max_kept
        if reindex:
            st.reindexed += st.next_pos - width
            st.next_pos = width
            st.cell_pos = torch.arange(width, dtype=torch.int64)
        else:
            st.cell_pos = torch.arange(st.next_pos - width, st.next_pos, dtype=torch.int64)
            st.reindexable = False
        st.compressed = True
        st.timings["apply_s"] = st.timings.get("apply_s", 0.0) + time.perf_counter() - t0

    def rollback(self, seq: int, n_tokens: int) -> None:
        """Forget the last `n_tokens` appended to `seq` (the native engine's rollback: the sequence's last
        slots here, since the reference appends every token at the end)."""
        st = self.seq(seq)
        if n_tokens < 0 or n_tokens > min(st.next_pos, st.cells):
            raise KvcliError(f"cannot roll back {n_tokens} tokens of sequence {seq} (it has {st.next_pos} positions)")
        if n_tokens == 0:
            return
        self.truncate(seq, st.next_pos - n_tokens)
        st.prompt_tokens = min(st.prompt_tokens, st.next_pos + st.reindexed)

    def truncate(self, seq: int, pos: int) -> None:
        """Remove every entry of `seq` at position >= `pos` (the native engine's truncate): each layer's last
        slots, since the reference appends every token at the end. Unlike `rollback`, it leaves `prompt_tokens`."""
        st = self.seq(seq)
        n_tokens = st.next_pos - pos
        if not 0 <= n_tokens <= min(st.next_pos, st.cells):
            raise KvcliError(f"cannot truncate sequence {seq} at position {pos} (it has {st.next_pos} positions)")
        st.cell_pos = st.cell_pos[:st.cells - n_tokens]
        for layer, s in zip(st.cache.layers, st.slots):
            keep = s.n_slots - n_tokens
            layer.keys = layer.keys[:, :, :keep].contiguous()
            layer.values = layer.values[:, :, :keep].contiguous()
            s.key_pos, s.bias = s.key_pos[:, :keep].contiguous(), s.bias[:, :keep].contiguous()
        st.next_pos = pos
        st.last_logits = None  # they belonged to a removed token

    def kept_positions(self, seq: int = 0) -> list[list[np.ndarray]]:
        """Positions of the live entries of each (layer, KV head), in slot order (decoded tokens included):
        original positions, or B-k..B-1 after a re-indexing compaction."""
        st = self.seq(seq)
        return [[s.key_pos[h][torch.isfinite(s.bias[h])].to(torch.int32).numpy() for h in range(s.key_pos.shape[0])]
                for s in (st.slots[il] for il in st.kv_layers)]

    # ------------------------------------------------------------------ stats
    def bytes_per_cell(self) -> int:
        """K + V bytes one uncompressed cell takes over all layers (the reference cache is float32)."""
        return self.info.cell_bytes("f32")

    def bytes_allocated(self) -> int:
        """Bytes of the storage behind every sequence's K, V and slot-bias tensors (the reference cache grows
        on demand: this is what it holds now, each storage counted once)."""
        seen = {}
        for st in self.seqs.values():
            tensors = [t for layer in st.cache.layers for t in (layer.keys, layer.values) if t is not None]
            tensors += [s.bias for s in st.slots] if st.compressed else []
            for t in tensors:
                u = t.untyped_storage()
                seen[u.data_ptr()] = u.nbytes()
        return int(sum(seen.values()))

    def stats(self, seq: int = 0) -> dict:
        """Sizes measured from the tensors the cache holds (float32 K and V, float32 bias). As the native engine's:
        kv_cells, kv_bytes, kv_bytes_full and kv_bytes_live cover the layers plans cover; kv_bytes counts each
        layer's slots from its first live one on, as the native ragged layout holds them (this engine's tensors keep
        the leading dead slots: kv_bytes_allocated); per_layer_cells lists
        every model layer, and a model with sliding-window layers adds sliding_layers, sliding_window,
        sliding_cells and sliding_bytes: what the sliding layers hold (here every entry; the window is the
        attention mask's, see the module doc)."""
        st = self.seq(seq)
        i = self.info
        layers = [(st.cache.layers[il], st.slots[il]) for il in i.kv_layers if il < len(st.cache.layers)]
        kv = sum(_kv_bytes(layer, _front(s) if st.compressed else 0) for layer, s in layers)
        bias = sum(s.bias.numel() * s.bias.element_size() for _, s in layers) if st.compressed else 0
        full = st.tokens_read * i.n_layer * i.n_head_kv * i.head_dim * 2 * 4
        live = sum(int(torch.isfinite(s.bias).sum()) for _, s in layers)   # live (layer, KV head, slot) entries
        sliding = {}
        if i.sliding_layers:
            cells = st.slots[i.sliding_layers[0]].n_slots
            sliding = {"sliding_layers": list(i.sliding_layers), "sliding_window": i.sliding_window,
                       "sliding_cells": cells, "sliding_bytes": cells * i.sliding_cell_bytes("f32")}
        return {"kv_cells": st.cells, "kv_bytes": int(kv + bias), "kv_bytes_full": int(full),
                "kv_bytes_live": live * i.head_dim * 2 * 4,
                "kv_bytes_allocated": self.bytes_allocated(), "kv_cells_allocated": self.n_ctx,
                "per_layer_cells": [s.n_live_slots for s in st.slots],
                **sliding,
                **{k: round(v, 4) for k, v in st.timings.items()}}


def _front(slots: LayerSlots) -> int:
    """The leading slots dead in every KV head: compaction right-aligns each head's entries, so a layer keeping
    fewer than the widest has them first. The native cache does not hold them (its ragged layout,
    native/src/README.md); this engine's tensors do, and kv_bytes counts as the native layout holds."""
    live = torch.isfinite(slots.bias).any(dim=0)
    return int(live.long().argmax()) if bool(live.any()) else slots.n_slots


def _kv_bytes(layer, front: int = 0) -> int:
    """K and V bytes of a layer's slots from `front` on."""
    if layer.keys is None:
        return 0
    per_slot = (layer.keys[0, :, :1].numel() * layer.keys.element_size()
                + layer.values[0, :, :1].numel() * layer.values.element_size())
    return (layer.keys.shape[2] - front) * per_slot


_BYTE_DECODER: dict | None = None


def _piece_bytes(piece: str) -> bytes:
    """Bytes of a token string: byte-level BPE (GPT-2 style: every byte mapped to a printable
    character) or SentencePiece ('▁' for space, '<0xNN>' byte tokens)."""
    global _BYTE_DECODER
    if _BYTE_DECODER is None:
        from transformers.convert_slow_tokenizer import bytes_to_unicode  # noqa: PLC0415
        _BYTE_DECODER = {c: b for b, c in bytes_to_unicode().items()}
    if all(ch in _BYTE_DECODER for ch in piece):
        return bytes(_BYTE_DECODER[ch] for ch in piece)
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
        return bytes([int(piece[3:5], 16)])
    return piece.replace("\u2581", " ").encode("utf-8")
