"""expected_attention: the attention future queries are expected to give each entry (Devoto et al. 2025; kvpress
ExpectedAttentionPress). Digest: docs/design/methods/expected_attention.md.

Per layer: the observed Q rows (the last `window` observed queries, post-RoPE) are turned back to before RoPE at their
positions (rows at positions below `sinks` left out); their mean mu and covariance Sigma (divided by the row count)
per query head are turned by the average RoPE rotation R of positions next..next+n_future-1. A key k (post-RoPE, as
cached) of slot j >= sinks gets softmax_j(mu_R.k / sqrt(d) + k' Sigma_R k / (2d)) per query head, combined over the
query heads of its KV head (`gqa`, mean), times ||v_j|| (+ epsilon first). The first `sinks` and last `recent` slots
are kept; the best (budget - sinks - recent) of the others per KV head, ties to the lower slot. float64.
Native twin: native/src/policies/expected_attention.cpp (the same float64 arithmetic in another order: identical plans
up to near-ties).
"""
import math

import numpy as np
import torch

from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation, Plan
from kvcli.reference.policies._common import check_nan, gqa_combine, keep_all, plan_from_kept, topk_ascending


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Every rotary pair (a, b) of the last axis turned by (cos, sin): a' = cos a - sin b, b' = sin a + cos b."""
    out = x.clone()
    out[..., a] = cos * x[..., a] - sin * x[..., b]
    out[..., b] = sin * x[..., a] + cos * x[..., b]
    return out


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    sinks, recent = params["sinks"], params["recent"]
    if obs.n <= budget:
        return keep_all(obs)
    if obs.queries is None or obs.rope is None:
        raise KvcliError("policy 'expected_attention' needs the query observation (observe \"query\")")
    L, H, d, n = obs.n_layer, obs.n_head_kv, obs.head_dim, obs.n
    G = obs.n_head // H
    freqs = torch.from_numpy(np.asarray(obs.rope.freqs, np.float64))
    a, b = (torch.from_numpy(x) for x in obs.rope.pairs())
    qpos = torch.from_numpy(np.asarray(obs.query_positions, np.int64))
    rows = qpos >= sinks
    rows[: max(0, len(rows) - params["window"])] = False   # the last `window` rows (all when the view holds fewer)
    if not bool(rows.any()):
        raise KvcliError("policy 'expected_attention': no observed query lies after the sinks")
    back = qpos[rows].to(torch.float64)[:, None] * freqs[None, :]                # [w, d/2]
    nxt = int(np.max(obs.positions)) + 1
    fut = torch.arange(nxt, nxt + params["n_future"], dtype=torch.float64)[:, None] * freqs[None, :]
    c_bar, s_bar = torch.cos(fut).mean(dim=0), torch.sin(fut).mean(dim=0)
    lo, hi = sinks, n - recent
    per = budget - sinks - recent
    head, tail = torch.arange(0, lo), torch.arange(hi, n)
    kept = []
    for l in range(L):
        q = torch.from_numpy(np.ascontiguousarray(obs.queries[l])).to(torch.float64)[:, rows, :]   # [Hq, w, d]
        check_nan(q)
        q = _turn(q, torch.cos(back), -torch.sin(back), a, b)                     # before RoPE
        mu = q.mean(dim=1)
        mu_r = _turn(mu, c_bar, s_bar, a, b)
        cov_r = None
        if params["covariance"] == "on":
            x = q - mu[:, None, :]
            cov = torch.matmul(x.transpose(1, 2), x) / q.shape[1]                   # [Hq, d, d]
            cov_r = _turn(_turn(cov, c_bar, s_bar, a, b).transpose(1, 2), c_bar, s_bar, a, b).transpose(1, 2)
        k, v = obs.layer_kv(l)
        keys = torch.from_numpy(np.ascontiguousarray(k[:, sinks:])).to(torch.float64)    # [H, n - sinks, d]
        vals = torch.from_numpy(np.ascontiguousarray(v[:, sinks:])).to(torch.float64)
        kq = keys.repeat_interleave(G, dim=0)                                           # [Hq, n - sinks, d]
        logit = torch.einsum("hnd,hd->hn", kq, mu_r) / math.sqrt(d)
        if cov_r is not None:
            logit = logit + torch.einsum("hnd,hde,hne->hn", kq, cov_r, kq) / (2 * d)
        probs = torch.softmax(logit, dim=-1)
        check_nan(probs)
        score = gqa_combine(probs, H, params["gqa"])                                   # [H, n - sinks]
        if params["vnorm"] == "on":
            score = (score + params["epsilon"]) * torch.linalg.vector_norm(vals, dim=-1)
        kept.append([torch.cat([head, lo + topk_ascending(score[h, : hi - lo], per, "expected_attention"), tail])
                     for h in range(H)])
    return plan_from_kept(kept)
