"""spindlekv (prefill): eviction by window attention with a linear depth schedule, then a similarity
codebook per (layer, KV head) whose groups become single cells (digest: docs/design/methods/spindlekv.md).

1. score[h, j]  = combine over the group's query heads of pool(sum over the window queries of
                  attention on j) (score_norm=causal_count: each sum divided by n - j first)
2. kept         = top k_l prefix slots + the window, k_l = layer_keep(...)      (Eq. 5-7)
3. codebooks    = greedy cover of the graph cos > theta over the kept keys (and values):
                  pick the alive entry with the most alive neighbours (lower slot on ties), it and
                  its alive neighbours form a group, repeat (Algorithm 1, incremental degrees)
4. one cell per key group, at the exemplar's slot, bias log(count):
                  K = unit(k_exemplar) x mean |k_i|,  V = mean of v_hat_i,
                  v_hat_i = unit(v of i's value exemplar) x |v_i|                 (Eq. 8-14)
Cosine similarities are the same float64 values as the C++ twin (see d2o.py: dots, cosine).
"""
from __future__ import annotations

import math

import numpy as np
import torch

from kvcli.planning.formats import Observation, Plan
from kvcli.policies.spindlekv import layer_keep
from kvcli.reference.policies._common import gqa_combine, keep_all, layer_kv, pool1d, rank_desc, require_kv, \
    require_window, topk_ascending, window_sum
from kvcli.reference.policies.d2o import cosine, sq_norms


def greedy_cover(x: torch.Tensor, theta: float) -> tuple[list[int], torch.Tensor]:
    """Algorithm 1 on the rows of x [N, d] float64: (exemplars in pick order, group id of every row).

    theta >= 1 means no codebook: every row is its own exemplar.
    """
    N = x.shape[0]
    if theta >= 1.0:
        return list(range(N)), torch.arange(N)
    adj = cosine(x, x) > theta
    adj.fill_diagonal_(True)                       # self-loops: every row gets covered
    deg = adj.sum(dim=1).to(torch.int64)
    alive = torch.ones(N, dtype=torch.bool)
    ref = torch.full((N,), -1, dtype=torch.int64)
    exemplars: list[int] = []
    while bool(alive.any()):
        cand = torch.where(alive, deg, torch.full_like(deg, -1))
        i = int(torch.argmax(cand))                  # first maximum: the lower slot
        members = adj[i] & alive
        ref[members] = len(exemplars)
        exemplars.append(i)
        alive &= ~members
        deg -= adj[:, members].sum(dim=1).to(torch.int64)
    return exemplars, ref


def codebook_cells(K: torch.Tensor, V: torch.Tensor, params: dict):
    """Merge the kept rows K, V [N, d] (float32, slot order) into cells.

    Returns (cell_rows: indices into the N rows of each cell's exemplar, ascending; counts;
    replacement {cell: (k, v)} for the cells whose rows differ from the exemplar's own rows).
    """
    K64, V64 = K.to(torch.float64), V.to(torch.float64)
    k_ex, k_ref = greedy_cover(K64, params["theta_k"])
    v_ex, v_ref = greedy_cover(V64, params["theta_v"])
    k_norm, v_norm = torch.sqrt(sq_norms(K64)), torch.sqrt(sq_norms(V64))

    def v_hat(i: int) -> torch.Tensor:
        e = v_ex[int(v_ref[i])]
        if e == i:
            return V64[i]
        return (V64[e] / v_norm[e]) * v_norm[i]

    cells = sorted(k_ex)
    counts, repl = [], {}
    for ci, e in enumerate(cells):
        members = torch.nonzero(k_ref == k_ref[e]).flatten().tolist()      # ascending
        counts.append(len(members))
        if len(members) == 1:
            v = v_hat(e)
            if v_ex[int(v_ref[e])] != e:
                repl[ci] = (K64[e], v)
            continue
        if params["k_scale"] == "exemplar":
            k = K64[e]
        else:
            acc = 0.0
            for i in members:
                acc = acc + float(k_norm[i])
            k = (K64[e] / k_norm[e]) * (acc / len(members))
        acc_v = torch.zeros(V.shape[1], dtype=torch.float64)
        for i in members:
            acc_v = acc_v + v_hat(i)
        repl[ci] = (k, acc_v / len(members))
    return cells, counts, repl


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    w = params["window"]
    if obs.n <= budget:
        return keep_all(obs)
    window = require_window(obs, "spindlekv", w)
    require_kv(obs, "spindlekv")
    L, H, n = obs.n_layer, obs.n_head_kv, obs.n
    prefix = n - w
    keep = layer_keep(L, n, budget, w, params["beta"], params["low_budget"])
    cb_layers = params["codebook_layers"] or L
    recent = torch.arange(prefix, n)

    kept, log_mult, rep_entry, rep_k, rep_v = [], [], [], [], []
    offset = 0
    for l in range(L):
        if l < cb_layers:   # this layer's rows only, read before its scores as the native planner does
            keys, values = layer_kv(obs, l, "spindlekv")
        s = window_sum(window[l], prefix)                                   # [n_head, prefix]
        if params["score_norm"] == "causal_count":
            s = s / torch.arange(n, n - prefix, -1, dtype=torch.float64)
        s = gqa_combine(pool1d(s, params["kernel"], params["pool"]), H, params["gqa"])
        best = topk_ascending(s, keep[l], "spindlekv")
        heads = []          # per KV head: (kept slots ascending, log multiplicities, {index in kept: (k, v)})
        for h in range(H):
            slots = torch.cat([best[h].to(torch.int64), recent])
            if l >= cb_layers:
                heads.append((slots.tolist(), [0.0] * slots.numel(), {}))
                continue
            cells, counts, repl = codebook_cells(keys[h, slots], values[h, slots], params)
            heads.append((slots[cells].tolist(), [math.log(c) for c in counts], repl))
        if params["fill_heads"] == "widest" and l < cb_layers:
            heads = _fill_to_widest(heads, rank_desc(s, "spindlekv"), keep[l])
        row_k, row_m = [], []
        for slots, mult, repl in heads:
            row_k.append(np.asarray(slots, np.int32))
            row_m.append(np.asarray(mult, np.float32))
            for ci in sorted(repl):
                k, v = repl[ci]
                rep_entry.append(offset + ci)
                rep_k.append(k.to(torch.float32).numpy())
                rep_v.append(v.to(torch.float32).numpy())
            offset += len(slots)
        kept.append(row_k)
        log_mult.append(row_m)
    out = Plan.from_lists(kept, log_mult)
    if rep_entry:
        out.replace_entry = np.asarray(rep_entry, dtype=np.int32)
        out.replace_k = np.stack(rep_k).astype(np.float32)
        out.replace_v = np.stack(rep_v).astype(np.float32)
    return out


def _fill_to_widest(heads: list, order: torch.Tensor, k: int) -> list:
    """A layer holds as many slots per KV head as its widest head keeps (the ragged layout stores each layer as
    wide as that), so a head whose codebook merged more keeps its next-best context entries by score (`order`:
    [n_head_kv, prefix] slots by descending score; the first k are its kept ones) as single cells, up to the
    widest head's count: the memory held anyway holds live entries instead of dead slots."""
    width = max(len(slots) for slots, _, _ in heads)
    out = []
    for h, (slots, mult, repl) in enumerate(heads):
        extra = order[h, k:k + width - len(slots)].tolist()
        if not extra:
            out.append((slots, mult, repl))
            continue
        merged = sorted([(sl, m, repl.get(ci)) for ci, (sl, m) in enumerate(zip(slots, mult))]
                        + [(sl, 0.0, None) for sl in extra], key=lambda e: e[0])
        out.append(([sl for sl, _, _ in merged], [m for _, m, _ in merged],
                    {i: r for i, (_, _, r) in enumerate(merged) if r is not None}))
    return out
