"""The reference engine's attention: plain softmax attention over a compressible cache.

transformers lets a model use a registered attention function (`AttentionInterface`); ours is
registered as "kvcli" and does, for one layer, exactly what llama.cpp's patched `build_attn`
does:

    logits[q, j] = (Q[q] . K[j]) * scale + bias[kv(q), j]    (-inf where pos[j] > pos[q])
    P = softmax(logits)            output = P @ V

where `scale` is the model's (1/sqrt(head_dim) for most), `bias` the slot bias of docs/internals.md (0 for a
live entry, -inf for a slot this KV head does not use, log(m) for an entry standing for m merged tokens) and
`pos` the original position of each (KV head, slot). Q and K arrive post-RoPE (the model's attention rotates
them before it calls us), so what we see is what the native engine observes.

A model that soft-caps its attention scores (gemma2: transformers passes `softcap`) caps them first,
(Q . K) * scale -> cap * tanh(. / cap), and adds the bias after the cap, as llama.cpp does (the bias is part of
its mask), so the observation is made of the capped scores too.

A sliding-window layer (gemma2's, gemma3's; `LayerSlots.sliding_window` = n) also masks the entries a query
no longer sees, as llama.cpp's iSWA cache does (LLAMA_SWA_TYPE_STANDARD, `is_masked_swa`): -inf where
pos[q] - pos[j] >= n. Such a layer is never compacted nor observed: it keeps every entry, the window is the mask's.

While an `Observer` is armed (prefill only), the same P of each layer it observes is also reduced as it is
computed, block of queries by block: the rows of the window queries summed per window length
(`Observation.window_sums`) and the column sums over every query (`Observation.colsum`), both in float64. Nothing is
recomputed
for the observation (it is the attention itself) and no attention row is kept.

The function reads its per-call state from `_ACTIVE`, set by the session around each forward
pass (`active(...)`), so the model object itself stays a stock transformers model.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

ATTN_NAME = "kvcli"
QUERY_CHUNK = 256   # queries per block: bounds the [n_head, chunk, n] probability matrix in memory


@dataclass
class LayerSlots:
    """What the attention of one layer needs beyond K/V: per (KV head, slot) position and bias."""

    key_pos: torch.Tensor    # int64 [n_head_kv, L]: original position of each entry
    bias: torch.Tensor       # float32 [n_head_kv, L]: 0, -inf or log(m)
    sliding_window: int = 0  # n > 0: a sliding-window layer, a query at p sees the entries at p - n < p' <= p

    @classmethod
    def empty(cls, n_head_kv: int, sliding_window: int = 0) -> "LayerSlots":
        return cls(torch.zeros(n_head_kv, 0, dtype=torch.int64), torch.zeros(n_head_kv, 0, dtype=torch.float32),
                   sliding_window)

    @property
    def n_slots(self) -> int:
        return int(self.key_pos.shape[1])

    @property
    def n_live_slots(self) -> int:
        """Slots where some KV head holds a live entry (the native engine's per-layer cell count)."""
        return int(torch.isfinite(self.bias).any(dim=0).sum())

    def append(self, q_pos: torch.Tensor) -> None:
        """New tokens enter every KV head as live entries at their own positions."""
        h = self.key_pos.shape[0]
        self.key_pos = torch.cat([self.key_pos, q_pos.expand(h, -1)], dim=1)
        self.bias = torch.cat([self.bias, torch.zeros(h, q_pos.numel(), dtype=torch.float32)], dim=1)


@dataclass
class Observer:
    """Reduces the attention probabilities of one prefill: per window length, the rows of its window
    queries summed; the column sums over every query. Both per observed layer, [n_head, L] float64."""

    layers: tuple                                      # model layers observed (ModelInfo.kv_layers), in order
    kinds: frozenset
    window_pos0: tuple = ()                            # per window length: queries at positions >= this
    window: list = field(default_factory=list)         # per window length, per observed layer: [n_head, L] float64
    colsum: list = field(default_factory=list)         # per observed layer: [n_head, L] float64
    colmax: list = field(default_factory=list)         # per observed layer: [n_head, L], the largest probability
    query_pos0: int | None = None                      # "query": the Q rows of queries at positions >= this
    queries: list = field(default_factory=list)        # per observed layer: [n_head, rows, d] (post-RoPE, HF order)
    query_positions: list = field(default_factory=list)

    def __post_init__(self):
        self.index = {il: i for i, il in enumerate(self.layers)}
        self.window = [[None] * len(self.layers) for _ in self.window_pos0]
        self.colsum = [None] * len(self.layers)
        self.colmax = [None] * len(self.layers)
        self.queries = [None] * len(self.layers)

    def observes(self, layer: int) -> bool:
        return layer in self.index

    def record_queries(self, layer: int, q: torch.Tensor, q_pos: torch.Tensor, scaling: float) -> None:
        """q: [n_head, rows, d], the layer's queries as attention uses them (logit = q.k x scaling), at positions
        q_pos [rows]; kept scaled so that the logit is q.k / sqrt(d), as the native engine keeps them."""
        if self.query_pos0 is None:
            return
        rows = q_pos >= self.query_pos0
        if not rows.any():
            return
        i = self.index[layer]
        got = q[:, rows, :].to(torch.float32)
        f = scaling * math.sqrt(q.shape[-1])
        if abs(f - 1.0) > 1e-6:
            got = got * f
        self.queries[i] = got if self.queries[i] is None else torch.cat([self.queries[i], got], dim=1)
        if i == 0:
            self.query_positions.extend(int(p) for p in q_pos[rows])

    def record(self, layer: int, probs: torch.Tensor, q_pos: torch.Tensor) -> None:
        """probs: [n_head, rows, L] of model layer `layer` for queries at positions q_pos [rows]. float64 sums:
        the reference should not add rounding."""
        layer = self.index[layer]
        if "window" in self.kinds:
            for i, pos0 in enumerate(self.window_pos0):
                rows = q_pos >= pos0
                if rows.any():
                    self.window[i][layer] = _add(self.window[i][layer], probs[:, rows, :].to(torch.float64).sum(dim=1))
        if "colsum" in self.kinds:
            self.colsum[layer] = _add(self.colsum[layer], probs.to(torch.float64).sum(dim=1))
        if "colmax" in self.kinds:   # a maximum adds no rounding: kept in the probabilities' own precision
            m = probs.amax(dim=1)
            self.colmax[layer] = m if self.colmax[layer] is None else torch.maximum(self.colmax[layer], m)


def _add(acc: torch.Tensor | None, s: torch.Tensor) -> torch.Tensor:
    return s if acc is None else acc + s


@dataclass
class ForwardState:
    """What one forward pass of one sequence needs: its slots per layer, query positions, observer."""

    layers: list                       # LayerSlots per model layer
    q_pos: torch.Tensor                # int64 [q_len]
    observer: Observer | None = None


_ACTIVE: ForwardState | None = None


@contextlib.contextmanager
def active(state: ForwardState):
    """Make `state` the one the attention layers read during this forward pass."""
    global _ACTIVE
    if _ACTIVE is not None:
        raise RuntimeError("nested reference forward passes are not supported")
    _ACTIVE = state
    try:
        yield state
    finally:
        _ACTIVE = None


def kvcli_attention(module, query, key, value, attention_mask, scaling: float, dropout: float = 0.0,
                    softcap: float | None = None, **kwargs):
    """transformers attention interface: query [1, n_head, q, d], key/value [1, n_head_kv, L, d]
    (the whole cache of this layer, new tokens included). Returns ([1, q, n_head, d], None).
    `attention_mask` (and transformers' `sliding_window`) is ignored: causality and the window come from the slot
    positions, which stay right after a compaction when slot index and position no longer agree."""
    st = _ACTIVE
    if st is None:
        raise RuntimeError("the kvcli attention runs only inside a ReferenceSession forward pass")
    if query.shape[0] != 1:
        raise RuntimeError("the reference engine runs one sequence at a time")
    layer = module.layer_idx
    slots: LayerSlots = st.layers[layer]
    slots.append(st.q_pos)
    if slots.n_slots != key.shape[2]:
        raise RuntimeError(f"layer {layer}: cache holds {key.shape[2]} entries but {slots.n_slots} slots are tracked")

    n_head, n_head_kv = query.shape[1], key.shape[1]
    group = n_head // n_head_kv                     # query head q reads KV head q // group
    q = query[0]
    k = key[0].repeat_interleave(group, dim=0)      # [n_head, L, d]
    v = value[0].repeat_interleave(group, dim=0)
    bias = slots.bias.repeat_interleave(group, dim=0)[:, None, :]        # [n_head, 1, L]
    key_pos = slots.key_pos.repeat_interleave(group, dim=0)[:, None, :]  # [n_head, 1, L]
    observer = st.observer if st.observer is not None and st.observer.observes(layer) else None

    if observer is not None:
        observer.record_queries(layer, q, st.q_pos, scaling)
    out = torch.empty_like(q)
    for r0 in range(0, q.shape[1], QUERY_CHUNK):
        r1 = min(r0 + QUERY_CHUNK, q.shape[1])
        pos = st.q_pos[r0:r1][None, :, None]
        masked = key_pos > pos
        if slots.sliding_window:
            masked |= pos - key_pos >= slots.sliding_window
        logits = torch.matmul(q[:, r0:r1], k.transpose(1, 2)) * scaling
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        probs = torch.softmax((logits + bias).masked_fill(masked, float("-inf")), dim=-1)
        out[:, r0:r1] = torch.matmul(probs, v)
        if observer is not None:
            observer.record(layer, probs, st.q_pos[r0:r1])
    return out.transpose(0, 1).unsqueeze(0).contiguous(), None


def hf_to_gguf_dims(k: torch.Tensor, permuted: bool = True) -> torch.Tensor:
    """K rows from transformers' dimension order to llama.cpp's (the GGUF layout), last axis head_dim.

    llama.cpp's converter permutes the Q/K weight rows so that its "normal" RoPE rotates adjacent
    pairs (2j, 2j+1); transformers un-permutes them on load and rotates (j, j + d/2) instead. Scores
    are the same (Q and K are permuted alike), but K rows are not: llama.cpp's dimension 2j+i is
    transformers' dimension i*d/2 + j. Observations and plans use llama.cpp's order, the native cache's.
    `permuted=False` (NEOX-RoPE architectures: qwen2, qwen3, phi3): both orders are the same.
    """
    if not permuted:
        return k
    d = k.shape[-1]
    return k.reshape(*k.shape[:-1], 2, d // 2).transpose(-1, -2).reshape(k.shape)


def gguf_to_hf_dims(k: torch.Tensor, permuted: bool = True) -> torch.Tensor:
    """Inverse of hf_to_gguf_dims."""
    if not permuted:
        return k
    d = k.shape[-1]
    return k.reshape(*k.shape[:-1], d // 2, 2).transpose(-1, -2).reshape(k.shape)


def no_mask(*args, **kwargs):
    """The mask builder paired with kvcli_attention: it builds its own mask from slot positions."""
    return None


def register() -> str:
    """Register the attention function and its (empty) mask builder with transformers, once."""
    from transformers import AttentionInterface  # noqa: PLC0415
    from transformers.masking_utils import AttentionMaskInterface  # noqa: PLC0415

    AttentionInterface.register(ATTN_NAME, kvcli_attention)
    AttentionMaskInterface.register(ATTN_NAME, no_mask)
    return ATTN_NAME
