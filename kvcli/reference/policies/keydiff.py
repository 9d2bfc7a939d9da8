"""keydiff: keep the keys least similar to their KV head's mean key (KeyDiff, Park et al. 2025; kvpress KeyDiffPress).

Per layer and KV head, over every slot j < n (float64 from the float32 rows, sums in a fixed order):
    khat_j = k_j / |k_j|                     (0 for a zero key)
    anchor = (sum over j in slot order of khat_j) / n
    score_j = -(khat_j . anchor) / |anchor|  = -cos(k_j, anchor)   (0 when the anchor is zero)
The last `recent` slots are kept; the (budget - recent) best of the others, ties to the lower slot. Every dot product
and squared norm is summed over the dimensions in index order from 0.0, one multiplication then one addition per term,
as the C++ twin (native/src/policies/keydiff.cpp, compiled without contraction) does: identical plans.
"""
import torch

from kvcli.planning.formats import Observation, Plan
from kvcli.reference.policies._common import keep_all, layer_kv, plan_from_kept, require_kv, topk_ascending


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[..., d] . [..., d] -> [...], the terms added in index order from 0.0."""
    acc = torch.zeros(torch.broadcast_shapes(a.shape[:-1], b.shape[:-1]), dtype=torch.float64)
    for i in range(a.shape[-1]):
        acc = acc + a[..., i] * b[..., i]
    return acc


def scores(keys: torch.Tensor) -> torch.Tensor:
    """One layer's keys [n_head_kv, n, d] float32 -> each one's negative cosine to its head's anchor [n_head_kv, n]."""
    k = keys.to(torch.float64)
    norm = torch.sqrt(_dot(k, k))[..., None]
    khat = torch.where(norm > 0, k / torch.where(norm > 0, norm, torch.ones_like(norm)), torch.zeros_like(k))
    acc = torch.zeros((k.shape[0], k.shape[2]), dtype=torch.float64)
    for j in range(k.shape[1]):
        acc = acc + khat[:, j]
    anchor = acc / k.shape[1]
    a_norm = torch.sqrt(_dot(anchor, anchor))[:, None]
    dots = _dot(khat, anchor[:, None, :])
    return torch.where(a_norm > 0, -(dots / torch.where(a_norm > 0, a_norm, torch.ones_like(a_norm))),
                       torch.zeros_like(dots))


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    recent = params["recent"]
    if obs.n <= budget:
        return keep_all(obs)
    require_kv(obs, "keydiff")
    hi = obs.n - recent
    tail = torch.arange(hi, obs.n)
    kept = []
    for l in range(obs.n_layer):
        keys, _ = layer_kv(obs, l, "keydiff")
        s = scores(keys)
        best = topk_ascending(s[:, :hi], budget - recent, "keydiff")
        kept.append([torch.cat([best[h], tail]) for h in range(obs.n_head_kv)])
    return plan_from_kept(kept)
