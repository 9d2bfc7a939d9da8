"""Applying a Plan to the reference engine's cache (docs/internals.md, "Plan"), with optional re-indexing.

The cache of layer `l` is transformers' DynamicCache layer: K and V of shape
[1, n_head_kv, L, head_dim], plus our `LayerSlots` (position and bias of each (KV head, slot)). A plan's
layer l is the model layer `layers[l]` (ModelInfo.kv_layers: the global layers of a model with sliding-window
layers, which are never compacted; every layer otherwise).

Layout: the native cache's. A plan rewrites *every* layer into B = `plan.max_kept` slots (the
widest (layer, head) of the whole model: llama.cpp's cells are shared by all layers). Slot j of
(l, h) holds the j-th kept entry of (l, h); a (l, h) that keeps fewer than B entries is padded with
dead slots (bias -inf, K and V zero, as in the native cache). Tokens decoded afterwards are slots
B, B+1, ..., in both engines, so plans made on either engine's observation are interchangeable.

Repeated compaction: an entry's new bias is its old bias plus the plan's log-multiplicity (a dead
entry a plan picks stays dead, a merged entry keeps its log(m) and can be merged into again).

Re-indexing (`rotate` given): the kept entries of each (l, h) are right-aligned: slots B-k..B-1 with
the positions B-k..B-1 in slot order (slot order is position order: plans keep slots ascending and
new tokens always come at higher positions), dead padding slots 0..B-k-1 first, and their K rows are
re-rotated by delta = new - old. Right-aligned, the latest entry of every (l, h) sits at B-1, next to
the continuation at B, whatever each (l, h) keeps (native/src/kvcli_cache.cpp says why).
Replacement rows of merged entries are in the space of the observation (rotated at the entry's old
position), so they are written first and re-rotated with the others.
"""
from __future__ import annotations

import sys

import numpy as np
import torch

from kvcli.planning.formats import Plan
from kvcli.reference.attention import LayerSlots, gguf_to_hf_dims


def entry_locations(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every entry of `plan.slots`: its (layer, kv head, index j within that head's list)."""
    counts = plan.n_kept.reshape(-1).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    flat_head = np.repeat(np.arange(counts.size), counts)       # which (l, h) each entry belongs to
    j = np.arange(int(counts.sum())) - starts[flat_head]
    layer, head = np.divmod(flat_head, plan.n_head_kv)
    return layer, head, j


class KeyRotation:
    """Re-rotates cached K rows by a per-entry position delta with the model's own rotary embedding.

    RoPE rotations compose (R(p + d) = R(d) R(p)), so a K row rotated at position p becomes the row
    rotated at p + d by one more rotation of angle d * inv_freq. cos/sin come from the model's
    `rotary_emb` (its rope type, theta, scaling and the file's factors, kvcli/reference/model.py). They carry
    its attention scaling (YaRN's mscale, `rope.scaling.attn_factor`; 1 otherwise), which the stored row already
    has once: it is kept, because llama.cpp's K-shift (build_rope_shift, which the native re-indexing runs) passes
    the same mscale to ggml_rope_ext and so scales a shifted K row by it again.
    """

    def __init__(self, model):
        self.rotary = model.model.rotary_emb
        # the rotate_half of the model's own modelling code (transformers' (j, j + d/2) pairing)
        self.rotate_half = sys.modules[type(model).__module__].rotate_half
        # a rotary embedding per layer type (gemma3): compacted layers are global ones
        self.kwargs = {"layer_type": "full_attention"} if hasattr(self.rotary, "layer_types") else {}

    def __call__(self, keys: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """keys: [n_head_kv, L, head_dim] in transformers' order; delta: int64 [n_head_kv, L]."""
        h, n, d = keys.shape
        if n == 0:
            return keys
        cos, sin = self.rotary(keys.reshape(1, h * n, d), delta.reshape(1, h * n), **self.kwargs)
        cos = cos[0].reshape(h, n, d).to(keys.dtype)
        sin = sin[0].reshape(h, n, d).to(keys.dtype)
        return keys * cos + self.rotate_half(keys) * sin


def apply_plan(cache, slots: list[LayerSlots], plan: Plan, rotate: KeyRotation | None = None,
               qk_permuted: bool = True, layers=None) -> None:
    """Rewrite the layers of `cache` (a DynamicCache) and `slots` that the plan covers as it says, in place:
    `layers[l]` is the model layer of the plan's layer l (default: l). With `rotate`, the kept entries are
    re-indexed (see the module doc). `qk_permuted`: the model's K dimension order differs from llama.cpp's
    (llama; see hf_to_gguf_dims)."""
    log_mult = None if plan.log_mult is None else torch.from_numpy(plan.log_mult.astype(np.float32))
    offsets = plan.offsets()
    rep_layer, rep_head, rep_j = (a[plan.replace_entry] for a in entry_locations(plan)) \
        if plan.replace_entry.size else (np.zeros(0, np.int64),) * 3
    width = plan.max_kept                       # every layer: the widest (layer, head) of the model

    for l, il in enumerate(range(plan.n_layer) if layers is None else layers):
        layer = cache.layers[il]
        n_head_kv, head_dim = layer.keys.shape[1], layer.keys.shape[3]
        index = torch.zeros(n_head_kv, width, dtype=torch.int64)        # padding reads slot 0 ...
        live = torch.zeros(n_head_kv, width, dtype=torch.bool)          # ... and is then cleared
        added = torch.zeros(n_head_kv, width, dtype=torch.float32)
        start = [0] * n_head_kv                 # the first slot of each head's entries
        for h in range(n_head_kv):
            kept = torch.from_numpy(plan.kept(l, h).astype(np.int64))
            k = kept.numel()
            start[h] = plan.first_slot(l, h, reindexed=rotate is not None)
            entries = slice(start[h], start[h] + k)
            index[h, entries] = kept
            live[h, entries] = True
            if log_mult is not None:
                off = int(offsets[l, h])
                added[h, entries] = log_mult[off: off + k]
        # bias composes: an entry keeps what it carried (log(m) of an earlier merge, -inf if dead)
        bias = torch.where(live, slots[il].bias.gather(1, index) + added, torch.tensor(float("-inf")))
        rows = index[:, :, None].expand(-1, -1, head_dim)
        keys = layer.keys[0].gather(1, rows) * live[:, :, None]         # dead padding: zero rows, as native
        values = layer.values[0].gather(1, rows) * live[:, :, None]
        for r in np.nonzero(rep_layer == l)[0]:           # merged entries: their K/V rows are replaced
            h, j = int(rep_head[r]), start[int(rep_head[r])] + int(rep_j[r])
            # plans carry K rows in llama.cpp's dimension order (Observation.keys): back to ours
            keys[h, j] = gguf_to_hf_dims(torch.from_numpy(plan.replace_k[r].astype(np.float32)), qk_permuted)
            values[h, j] = torch.from_numpy(plan.replace_v[r].astype(np.float32))
        key_pos = slots[il].key_pos.gather(1, index)
        if rotate is not None:
            new_pos = torch.arange(width, dtype=torch.int64).expand(n_head_kv, -1).contiguous()
            keys = rotate(keys, torch.where(live, new_pos - key_pos, 0))
            key_pos = new_pos
        layer.keys = keys.unsqueeze(0).contiguous()
        layer.values = values.unsqueeze(0).contiguous()
        slots[il] = LayerSlots(key_pos=key_pos, bias=bias)
