"""h2o (prefill variant): heavy hitters by attention accumulated over every prompt query + recent tokens.

score[h, j] = combine over the query heads q of KV head h of colsum[q, j]
(colsum = the sum over all prefill queries of their attention on slot j).
"""
import torch

from kvcli.planning.formats import Observation, Plan
from kvcli.reference.policies._common import check_nan, gqa_combine, keep_all, plan_from_kept, \
    require_colsum, topk_ascending


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    recent_n = params["recent"]
    if obs.n <= budget:
        return keep_all(obs)
    colsum = require_colsum(obs, "h2o")
    prefix = obs.n - recent_n
    recent = torch.arange(prefix, obs.n)
    kept = []
    for l in range(obs.n_layer):
        per_q = colsum[l, :, :prefix].to(torch.float64)
        check_nan(per_q)
        scores = gqa_combine(per_q, obs.n_head_kv, params["gqa"])
        best = topk_ascending(scores, budget - recent_n, "h2o")
        kept.append([torch.cat([best[h], recent]) for h in range(obs.n_head_kv)])
    return plan_from_kept(kept)
