"""dynamickv: SnapKV scores per layer, per-layer budgets from a progressive global top-k.

Per layer l and KV head h, s[l, h, j] is SnapKV's pooled window score of prefix slot j. Every
`interval` layers (and at the last), the base x n_head_kv x (l + 1) best scores over all layers
seen so far are counted per layer; each layer's share of that count becomes its share of the
total budget (base = budget - window, total = base x n_layer), and a layer's budget can only
shrink. At the end each (l, h) keeps its budget's best prefix slots plus the window.
(Digest: docs/design/methods/dynamickv.md §2.3; this is the per-KV-head variant.)
"""
import math

import torch

from kvcli.planning.formats import Observation, Plan
from kvcli.reference.policies._common import keep_all, plan_from_kept, rank_desc, \
    record_selection, require_window, snap_scores


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    ws, m = params["window"], params["interval"]
    if obs.n <= budget:
        return keep_all(obs)
    window = require_window(obs, "dynamickv", ws)
    L, H = obs.n_layer, obs.n_head_kv
    P = obs.n - ws                                   # selectable prefix
    base = budget - ws
    bmax = min(int(params["r_max"] * base), P)       # provisional per-layer maximum B^l
    total = base * L

    scores, ranks, cur = [], [], [0] * L
    for l in range(L):
        s = snap_scores(window[l], H, P, params["kernel"], params["pool"], params["gqa"])   # [H, P]
        scores.append(s)
        ranks.append(rank_desc(s, "dynamickv"))
        cur[l] = bmax
        if not (l % m == m - 1 or l == L - 1):
            continue
        n_seen = l + 1
        flat = torch.stack(scores).reshape(-1)       # (layer, head, slot) order: ties go to the lower
        k = min(base * H * n_seen, flat.numel())
        top = rank_desc(flat, "dynamickv")[:k]
        counts = torch.bincount(top // (H * P), minlength=n_seen).tolist()
        c = [x // n_seen for x in counts]            # Eq. 4's 1/n, integer floor as the authors' code
        sum_c = sum(c)
        if l == L - 1:                               # the code's rounding fix-up at the last update
            c[l] += base * H - sum_c
            sum_c = base * H
        if sum_c <= 0:
            continue
        Z = [int(bmax * (cj / sum_c)) for cj in c]   # Eq. 5 (its division by max(C) cancels in Eq. 6)
        if sum(Z) <= 0:
            continue
        r = sum(Z) / total
        Zp = [math.floor(z / r) for z in Z]          # Eq. 6: renormalise to the total budget
        Zp[l] += total - sum(Zp)                     # residual to the most recent layer
        for j in range(n_seen):
            cur[j] = min(cur[j], Zp[j], P)           # shrink only (the code's slice never grows a layer)

    recent = torch.arange(P, obs.n)
    for l in range(L):
        record_selection(scores[l], cur[l])
    kept = [[torch.cat([torch.sort(ranks[l][h, :cur[l]]).values, recent]) for h in range(H)] for l in range(L)]
    return plan_from_kept(kept)
