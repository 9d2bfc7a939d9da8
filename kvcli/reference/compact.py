"""Applying a Plan to the reference engine's cache (docs/internals.md, "Plan").

The cache of layer `l` is transformers' DynamicCache layer: K and V of shape
[1, n_head_kv, L, head_dim], plus our `LayerSlots` (position and bias of each (KV head, slot)).
A plan rewrites layer `l` into `width_l = max_h n_kept[l, h]` slots, so each layer gets its own
length (real memory savings per layer). Inside a layer, heads that keep fewer than `width_l`
entries are padded with slots whose bias is -inf: no query ever attends to them. This is the
same layout as the native cache, except that the native cache pads every layer to the widest
layer of the whole model (its cells are shared by all layers).
"""
from __future__ import annotations

import numpy as np
import torch

from kvcli.plan import Plan
from kvcli.reference.attention import LayerSlots, gguf_to_hf_dims


def entry_locations(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For every entry of `plan.slots`: its (layer, kv head, index j within that head's list)."""
    counts = plan.n_kept.reshape(-1).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    flat_head = np.repeat(np.arange(counts.size), counts)       # which (l, h) each entry belongs to
    j = np.arange(int(counts.sum())) - starts[flat_head]
    layer, head = np.divmod(flat_head, plan.n_head_kv)
    return layer, head, j


def apply_plan(cache, slots: list[LayerSlots], plan: Plan) -> None:
    """Rewrite every layer of `cache` (a DynamicCache) and `slots` as the plan says, in place."""
    log_mult = None if plan.log_mult is None else torch.from_numpy(plan.log_mult.astype(np.float32))
    offsets = plan.offsets()
    rep_layer, rep_head, rep_j = (a[plan.replace_entry] for a in entry_locations(plan)) \
        if plan.replace_entry.size else (np.zeros(0, np.int64),) * 3

    for l in range(plan.n_layer):
        layer = cache.layers[l]
        n_head_kv, head_dim = layer.keys.shape[1], layer.keys.shape[3]
        width = int(plan.n_kept[l].max()) if plan.n_head_kv else 0
        index = torch.zeros(n_head_kv, width, dtype=torch.int64)        # padding reads slot 0 ...
        bias = torch.full((n_head_kv, width), float("-inf"))             # ... and is masked out
        for h in range(n_head_kv):
            kept = torch.from_numpy(plan.kept(l, h).astype(np.int64))
            index[h, :kept.numel()] = kept
            if log_mult is None:
                bias[h, :kept.numel()] = 0.0
            else:
                off = int(offsets[l, h])
                bias[h, :kept.numel()] = log_mult[off: off + kept.numel()]
        rows = index[:, :, None].expand(-1, -1, head_dim)
        keys = layer.keys[0].gather(1, rows)
        values = layer.values[0].gather(1, rows)
        for r in np.nonzero(rep_layer == l)[0]:           # merged entries: their K/V rows are replaced
            h, j = int(rep_head[r]), int(rep_j[r])
            # plans carry K rows in llama.cpp's dimension order (Observation.keys): back to ours
            keys[h, j] = gguf_to_hf_dims(torch.from_numpy(plan.replace_k[r].astype(np.float32)))
            values[h, j] = torch.from_numpy(plan.replace_v[r].astype(np.float32))
        layer.keys = keys.unsqueeze(0).contiguous()
        layer.values = values.unsqueeze(0).contiguous()
        slots[l] = LayerSlots(key_pos=slots[l].key_pos.gather(1, index), bias=bias)
