"""snapkv: keep the prompt entries the last `window` queries attend to most, per KV head.

score[h, j] = combine over the query heads q of KV head h of
              pool( sum over the last `window` queries r of attention[q, r, j] )
The (budget - window) best prefix slots are kept, plus the window itself.
"""
import torch

from kvcli.planning.formats import Observation, Plan
from kvcli.reference.policies._common import keep_all, plan_from_kept, require_window, \
    snap_scores, topk_ascending


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    w = params["window"]
    if obs.n <= budget:
        return keep_all(obs)
    window = require_window(obs, "snapkv", w)
    prefix = obs.n - w
    recent = torch.arange(prefix, obs.n)
    kept = []
    for l in range(obs.n_layer):
        scores = snap_scores(window[l], obs.n_head_kv, prefix, params["kernel"], params["pool"], params["gqa"])
        best = topk_ascending(scores, budget - w, "snapkv")          # [n_head_kv, budget - w]
        kept.append([torch.cat([best[h], recent]) for h in range(obs.n_head_kv)])
    return plan_from_kept(kept)
