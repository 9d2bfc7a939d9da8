"""tova: keep the entries the last prompt query attends to most (TOVA, Oren et al. 2024; kvpress TOVAPress).

score[j] = the attention slot j < n - window got from the last `window` queries (window 1: the last token), summed
(the engine's window sums), then combined over query heads: gqa=layer averages every query head of the layer (heads
added in order, one division), the same score for each KV head; mean|max|sum combine the heads of each KV head's
group. The (budget - window) best slots are kept per KV head, plus the last `window`; ties to the lower slot.
"""
import torch

from kvcli.planning.formats import Observation, Plan
from kvcli.reference.policies._common import gqa_combine, keep_all, plan_from_kept, require_window, topk_ascending, \
    window_sum


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    w = params["window"]
    if obs.n <= budget:
        return keep_all(obs)
    window = require_window(obs, "tova", w)
    prefix = obs.n - w
    recent = torch.arange(prefix, obs.n)
    kept = []
    for l in range(obs.n_layer):
        per_q = window_sum(window[l], prefix)                                     # [n_head, prefix]
        if params["gqa"] == "layer":
            s = gqa_combine(per_q, 1, "mean").expand(obs.n_head_kv, prefix)
        else:
            s = gqa_combine(per_q, obs.n_head_kv, params["gqa"])
        best = topk_ascending(s, budget - w, "tova")
        kept.append([torch.cat([best[h], recent]) for h in range(obs.n_head_kv)])
    return plan_from_kept(kept)
