"""pyramidkv: SnapKV's selection, with more entries in lower layers (KVCache-Factory's schedule)."""
import torch

from kvcli.planning.formats import Observation, Plan
from kvcli.policies.pyramidkv import layer_budgets
from kvcli.reference.policies._common import keep_all, plan_from_kept, require_window, \
    snap_scores, topk_ascending


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    w = params["window"]
    if obs.n <= budget:
        return keep_all(obs)
    window = require_window(obs, "pyramidkv", w)
    prefix = obs.n - w
    recent = torch.arange(prefix, obs.n)
    budgets = layer_budgets(obs.n_layer, obs.n, budget, w, params["beta"], params["schedule"])
    kept = []
    for l in range(obs.n_layer):
        scores = snap_scores(window[l], obs.n_head_kv, prefix, params["kernel"], params["pool"], params["gqa"])
        best = topk_ascending(scores, budgets[l], "pyramidkv")
        kept.append([torch.cat([best[h], recent]) for h in range(obs.n_head_kv)])
    return plan_from_kept(kept)
