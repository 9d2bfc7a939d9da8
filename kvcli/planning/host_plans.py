"""The native engine's planners that run in Python (numpy, float64) instead of C++ (PolicySpec.host_planned), with
the registry's parameters like the C++ ones; kvcli.planning.planner.make_plan calls them for planner="native". Their
torch twins are in kvcli/reference/policies/ and kvcli check's L1 compares the two on one observation.

expected_attention (Devoto et al. 2025; kvpress ExpectedAttentionPress; docs/design/methods/expected_attention.md):
why here and not in native/src/policies/ is in its registry entry's deviations (the model's RoPE and dense per-head
linear algebra).
"""
from __future__ import annotations

import math

import numpy as np

from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation, Plan


def plan(name: str, params: dict, budget: int, obs: Observation) -> Plan:
    if name != "expected_attention":
        raise KvcliError(f"policy '{name}' has no host planner")
    return expected_attention(obs, params, int(budget))


def query_statistics(obs: Observation, layer: int, sinks: int, n_future: int, covariance: bool):
    """(mu [n_head, d], cov [n_head, d, d] or None) of layer `layer`'s observed queries before RoPE (rows at
    positions below `sinks` left out), both turned by the average rotation of the n_future positions after the
    prompt. float64."""
    rope = obs.rope
    if obs.queries is None or rope is None:
        raise KvcliError("policy 'expected_attention' needs the query observation (observe \"query\")")
    keep = obs.query_positions >= sinks
    if not keep.any():
        raise KvcliError("policy 'expected_attention': no observed query lies after the sinks")
    q = rope.unrotate(obs.queries[layer][:, keep, :], obs.query_positions[keep])          # [H, w, d]
    if np.isnan(q).any():
        raise KvcliError("the observation contains NaN")
    mu = q.mean(axis=1)
    c, s = rope.mean_rotation(int(obs.positions.max()) + 1, n_future)
    cov = None
    if covariance:
        x = q - mu[:, None, :]
        cov = np.einsum("hwi,hwj->hij", x, x) / q.shape[1]
        cov = rope.turn(cov, c, s)                                   # rows turned: cov R^T
        cov = np.swapaxes(rope.turn(np.swapaxes(cov, 1, 2), c, s), 1, 2)   # R cov R^T
    return rope.turn(mu, c, s), cov


def expected_attention(obs: Observation, params: dict, budget: int) -> Plan:
    sinks, recent = params["sinks"], params["recent"]
    if obs.n <= budget:
        return Plan.keep_all(obs.n_layer, obs.n_head_kv, obs.n)
    L, H, Hq, d, n = obs.n_layer, obs.n_head_kv, obs.n_head, obs.head_dim, obs.n
    G = Hq // H
    lo, hi = sinks, n - recent            # selectable slots [lo, hi); the softmax runs over [sinks, n)
    per = budget - sinks - recent
    head, tail = np.arange(0, lo), np.arange(hi, n)
    kept = []
    for l in range(L):
        mu, cov = query_statistics(obs, l, sinks, params["n_future"], params["covariance"] == "on")
        k, v = obs.layer_kv(l)
        row = []
        for h in range(H):
            K = k[h, sinks:].astype(np.float64)                       # [n - sinks, d]
            per_q = np.empty((G, n - sinks))
            for g in range(G):
                q = h * G + g
                logit = K @ mu[q] / math.sqrt(d)
                if cov is not None:
                    logit = logit + np.einsum("nd,nd->n", K @ cov[q], K) / (2 * d)
                e = np.exp(logit - logit.max())
                per_q[g] = e / e.sum()
            if np.isnan(per_q).any():
                raise KvcliError("the observation contains NaN")
            if params["gqa"] == "max":
                score = per_q.max(axis=0)
            else:
                score = per_q[0].copy()
                for g in range(1, G):
                    score = score + per_q[g]
                if params["gqa"] == "mean":
                    score = score / G
            if params["vnorm"] == "on":
                vv = v[h, sinks:].astype(np.float64)
                score = (score + params["epsilon"]) * np.sqrt((vv * vv).sum(axis=1))
            sel = score[: hi - lo]                                    # slots lo..hi-1
            best = np.sort(np.argsort(-sel, kind="stable")[:per])
            row.append(np.concatenate([head, lo + best, tail]).astype(np.int32))
        kept.append(row)
    return Plan.from_lists(kept)
