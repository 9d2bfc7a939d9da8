"""compresskv: SnapKV's score, but only the layer's semantic retrieval heads (SRH) vote, and every KV
head of the layer keeps the same tokens; layer budgets B_l from the offline error profile.

score_l[j] = mean over the SRH query heads q of layer l (calibration order) of
             pool( sum over the last `window` queries of attention[q, r, j] )
Layer l keeps the (B_l - window) best prefix slots plus the window; B_l = allocate(layer_scores).
"""
import torch

from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation, Plan
from kvcli.policies.compresskv import layer_budgets
from kvcli.reference.policies._common import keep_all, plan_from_kept, pool1d, \
    require_window, topk_ascending, window_sum


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    w, k = params["window"], params["srh_k"]
    srh = list(params["srh"])
    if srh and len(srh) != obs.n_layer * k:
        raise KvcliError(f"policy 'compresskv': srh has {len(srh)} head ids, expected {obs.n_layer} layers x srh_k "
                         f"{k} (calibration from another model?)")
    if srh and max(srh) >= obs.n_head:
        raise KvcliError(f"policy 'compresskv': srh names query head {max(srh)}, the model has {obs.n_head} "
                         "(calibration from another model?)")
    budgets = layer_budgets(params, budget, obs.n_layer)
    if obs.n <= budget:
        return keep_all(obs)
    window = require_window(obs, "compresskv", w)
    prefix = obs.n - w
    kept = []
    for l in range(obs.n_layer):
        if obs.n <= budgets[l]:
            layer_kept = torch.arange(obs.n)
        else:
            heads = srh[l * k:(l + 1) * k] if srh else list(range(obs.n_head))
            per_head = pool1d(window_sum(window[l, heads], prefix), params["kernel"], params["pool"])
            score = per_head[0]
            for i in range(1, len(heads)):          # mean over the scoring heads, added in order
                score = score + per_head[i]
            if len(heads) > 1:
                score = score / len(heads)
            best = topk_ascending(score, max(0, budgets[l] - w), "compresskv")
            layer_kept = torch.cat([best, torch.arange(prefix, obs.n)])
        kept.append([layer_kept] * obs.n_head_kv)
    return plan_from_kept(kept)
