"""kvzip: the entries the reconstruction pass attends to most (Kim et al., NeurIPS 2025).

score[h, j] = combine over the query heads q of KV head h of colmax[q, j]
(colmax = the largest attention probability any query of the reconstruction pass gave slot j: the prompt fed
again after an instruction to repeat it, kvcli/policies/reconstruction.py). The first `sinks` and last `recent`
slots are kept; the (budget - sinks - recent) best of the others per KV head (alloc=head), per layer over its
KV heads (alloc=layer) or over every layer and KV head (alloc=global), ties to the lower flat (layer, head, slot).
"""
import numpy as np
import torch

from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation, Plan
from kvcli.reference.policies._common import check_nan, gqa_combine, keep_all, plan_from_kept, topk_ascending


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    sinks, recent = params["sinks"], params["recent"]
    if obs.n <= budget:
        return keep_all(obs)
    if obs.colmax is None:
        raise KvcliError("policy 'kvzip' needs the colmax observation (observe \"colmax\")")
    colmax = torch.from_numpy(np.ascontiguousarray(obs.colmax, dtype=np.float32))
    lo, hi = sinks, obs.n - recent
    L, H, P = obs.n_layer, obs.n_head_kv, hi - lo
    per = budget - sinks - recent
    scores = torch.empty((L, H, P), dtype=torch.float64)
    for l in range(L):
        per_q = colmax[l, :, lo:hi].to(torch.float64)
        check_nan(per_q)
        scores[l] = gqa_combine(per_q, H, params["gqa"])
    if params["alloc"] == "head":
        chosen = [[topk_ascending(scores[l, h], per, "kvzip") for h in range(H)] for l in range(L)]
    elif params["alloc"] == "layer":
        chosen = [_split(topk_ascending(scores[l].reshape(-1), per * H, "kvzip"), H, P) for l in range(L)]
    else:
        flat = _split(topk_ascending(scores.reshape(-1), per * H * L, "kvzip"), L * H, P)
        chosen = [flat[l * H:(l + 1) * H] for l in range(L)]
    head, tail = torch.arange(0, lo), torch.arange(hi, obs.n)
    return plan_from_kept([[torch.cat([head, lo + c, tail]) for c in layer] for layer in chosen])


def _split(flat: torch.Tensor, rows: int, P: int) -> list[torch.Tensor]:
    """Ascending flat indices into `rows` rows of P slots -> per row, its ascending slots."""
    return [flat[(flat // P) == r] % P for r in range(rows)]
