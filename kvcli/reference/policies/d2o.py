"""d2o (prefill): layer budgets from the variance of accumulated attention, H2O-style eviction per KV
head, and every evicted entry close enough to a kept key merged into it (digest: docs/design/methods/d2o.md).

1. sigma2[l]   = mean over query heads q of Var_j(colsum[l, q, j])      (Eq. 4, population variance)
2. C_l         = layer_budgets(softmax_l(1/sigma2), budget x L)          (Eq. 5, 13-16)
3. per KV head = first `sinks` slots that receive attention + top heavy hitters by combined colsum + last M_l
4. u_e, j*(e)  = max / argmax over kept c of cos(k_e, k_c); tau = mean of u_e
   entries with u_e >= tau merge into j*(e):                               (Eq. 9-12)
   k_c <- (e k_c + sum_i exp(u_i) k_i) / (e + sum_i exp(u_i)), v_c alike

Similarities are float64 dot products summed over head_dim in index order (the products of float32
values are exact in float64), divided by the product of the two norms: the C++ twin computes the same
doubles, so both engines make the same merge decisions.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from kvcli.planning.formats import Observation, Plan
from kvcli.policies.d2o import floor_entries, full_layer_set, layer_budgets, layer_weights, split
from kvcli.reference.policies._common import check_nan, gqa_combine, keep_all, layer_kv, require_colsum, \
    require_kv, topk_ascending


def column_variance(colsum: torch.Tensor) -> torch.Tensor:
    """[L, H, n] float32 -> population variance over n per (layer, query head), float64, sums in slot order."""
    cs = colsum.to(torch.float64)
    n = cs.shape[-1]
    acc = torch.zeros(cs.shape[:-1], dtype=torch.float64)
    for j in range(n):
        acc = acc + cs[..., j]
    mean = acc / n
    acc = torch.zeros_like(mean)
    for j in range(n):
        d = cs[..., j] - mean
        acc = acc + d * d
    return acc / n


def dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[E, d] x [C, d] float64 -> [E, C], each sum over d taken in index order from 0.0."""
    at, bt = a.T.contiguous(), b.T.contiguous()          # one contiguous row per dimension
    acc = torch.zeros((a.shape[0], b.shape[0]), dtype=torch.float64)
    for d in range(a.shape[1]):
        acc += torch.outer(at[d], bt[d])                 # float32 x float32 is exact in float64
    return acc


def sq_norms(a: torch.Tensor) -> torch.Tensor:
    at = a.T.contiguous()
    acc = torch.zeros(a.shape[0], dtype=torch.float64)
    for d in range(a.shape[1]):
        acc += at[d] * at[d]
    return acc


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Cosine similarity dot / (|a| |b|); 0 where either vector is zero."""
    den = torch.sqrt(sq_norms(a))[:, None] * torch.sqrt(sq_norms(b))[None, :]
    dot = dots(a, b)
    return torch.where(den > 0, dot / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(dot))


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    if obs.n <= budget:
        return keep_all(obs)
    colsum = require_colsum(obs, "d2o")
    require_kv(obs, "d2o")
    L, H, n = obs.n_layer, obs.n_head_kv, obs.n
    check_nan(colsum.to(torch.float64))

    full = full_layer_set(params["full_layers"], L)
    comp = [l for l in range(L) if l not in full]
    head_var = column_variance(colsum)                                  # [L, n_head]
    sigma2 = []
    for l in comp:
        acc = 0.0
        for q in range(obs.n_head):
            acc = acc + float(head_var[l, q])
        sigma2.append(acc / obs.n_head)
    weights = layer_weights(sigma2, [[float(v) for v in head_var[l]] for l in comp], params["allocation"])
    lo = floor_entries(n, params["min_frac"], budget)
    caps = dict(zip(comp, layer_budgets(weights, budget * len(comp), lo, n)))

    kept: list[list[torch.Tensor]] = []
    evicted: list[list[torch.Tensor]] = []
    for l in range(L):
        C = caps.get(l, n)
        if C >= n:
            kept.append([torch.arange(n)] * H)
            evicted.append([torch.zeros(0, dtype=torch.int64)] * H)
            continue
        M = split(C, params["heavy"], params["recent"])
        N = C - M
        prefix = n - M
        ns = min(params["sinks"], N, prefix)
        scores = gqa_combine(colsum[l, :, :prefix].to(torch.float64), H, params["gqa"])   # [H, prefix]
        row_k, row_e = [], []
        for h in range(H):
            # sinks: the first ns slots that receive attention (the dead padding a re-indexed compaction
            # puts first in a (layer, head) keeping fewer than the widest receives exactly none)
            sink = torch.nonzero(scores[h] > 0).flatten()[:ns]
            after = int(sink[-1]) + 1 if sink.numel() else 0
            best = topk_ascending(scores[h, after:], N - sink.numel(), "d2o") + after
            k = torch.cat([sink, best.to(torch.int64), torch.arange(prefix, n)])
            mask = torch.ones(n, dtype=torch.bool)
            mask[k] = False
            row_k.append(k)
            row_e.append(torch.nonzero(mask).flatten())
        kept.append(row_k)
        evicted.append(row_e)

    out = Plan.from_lists([[k.numpy().astype(np.int32) for k in layer] for layer in kept])
    if params["merge"] == "none":
        return out
    offsets = out.offsets()
    rep_entry, rep_k, rep_v = [], [], []
    for l in range(L):
        if all(e.numel() == 0 for e in evicted[l]):
            continue
        keys, values = layer_kv(obs, l, "d2o")                            # this layer's rows only
        # best similarity of every evicted entry, per KV head
        matches = []
        for h in range(H):
            e, c = evicted[l][h], kept[l][h]
            if e.numel() == 0:
                matches.append(None)
                continue
            K = keys[h].to(torch.float64)
            cos = cosine(K[e], K[c])
            j = torch.argmax(cos, dim=1)                                   # first maximum: lower kept slot
            u = cos[torch.arange(e.numel()), j]
            matches.append((j, u))
        taus = [None] * H
        if params["tau"] == "layer":
            acc, cnt = 0.0, 0
            for h in range(H):
                if matches[h] is not None:
                    for x in matches[h][1].tolist():
                        acc = acc + x
                    cnt += matches[h][1].numel()
            taus = [acc / cnt if cnt else None] * H
        else:
            for h in range(H):
                if matches[h] is not None:
                    acc = 0.0
                    for x in matches[h][1].tolist():
                        acc = acc + x
                    taus[h] = acc / matches[h][1].numel()
        for h in range(H):
            if matches[h] is None:
                continue
            j, u = matches[h]
            e, c = evicted[l][h], kept[l][h]
            K = keys[h].to(torch.float64)
            V = values[h].to(torch.float64)
            merged = u >= taus[h]
            src, tgt = e[merged], j[merged]
            if src.numel() == 0:
                continue
            # per kept entry t: sum of w_i x_i over the evicted entries merged into it (rows only need 1e-5)
            if params["merge"] == "paper":
                w = torch.exp(u[merged])
                self_w = torch.full((c.numel(),), math.e, dtype=torch.float64)
            else:   # code: scatter mean of u_i * x_i including the target itself
                w = u[merged]
                self_w = torch.ones(c.numel(), dtype=torch.float64)
            z = self_w.clone().index_add_(0, tgt, w if params["merge"] == "paper" else torch.ones_like(w))
            nk = (self_w[:, None] * K[c]).index_add_(0, tgt, w[:, None] * K[src]) / z[:, None]
            nv = (self_w[:, None] * V[c]).index_add_(0, tgt, w[:, None] * V[src]) / z[:, None]
            targets = torch.unique(tgt)                                     # ascending kept index
            rep_entry.extend((int(offsets[l, h]) + targets).tolist())
            rep_k.append(nk[targets].to(torch.float32).numpy())
            rep_v.append(nv[targets].to(torch.float32).numpy())
    if rep_entry:
        out.replace_entry = np.asarray(rep_entry, dtype=np.int32)
        out.replace_k = np.concatenate(rep_k).astype(np.float32)
        out.replace_v = np.concatenate(rep_v).astype(np.float32)
    return out

