"""windowkv: keep whole review windows of consecutive tokens, one choice per group of layers.

For the first layer of each group (the leader):
  t[q, j]  = attention slot j receives from the last `window` queries (query head q)
  review windows W_k = [k*omega, (k+1)*omega) over the review context [0, n - window)
  score_k  = mean over heads and tokens of t in W_k            (task=localization, "mean")
           = mean over heads of the mean of the top_p t in W_k (task=aggregation, "topp")
The best windows up to the group's budget are kept by every layer and head of the group,
plus the observation window. Group budgets: kvcli.policies.windowkv.group_budgets.
"""
import torch
import torch.nn.functional as F

from kvcli.planning.formats import Observation, Plan
from kvcli.policies.windowkv import group_budgets, group_size
from kvcli.reference.policies._common import keep_all, plan_from_kept, require_window, \
    topk_ascending, window_sum


def window_scores(t: torch.Tensor, omega: int, top_p: int, score: str) -> torch.Tensor:
    """t: [n_head, L] float64 -> one score per review window [N]. Sums run head by head, then token by
    token (mean: by position; topp: largest first), as the C++ planner adds them."""
    n_head, L = t.shape
    N = -(-L // omega)
    sizes = torch.clamp(L - torch.arange(N) * omega, max=omega)        # the last window may be partial
    acc = torch.zeros(N, dtype=torch.float64)
    if score == "mean":
        cnt = sizes
        tw = F.pad(t, (0, N * omega - L), value=0.0).reshape(n_head, N, omega)   # zero pads add nothing
        for q in range(n_head):
            for i in range(omega):
                acc = acc + tw[q, :, i]
    else:
        cnt = torch.clamp(sizes, max=top_p)
        tw = F.pad(t, (0, N * omega - L), value=float("-inf")).reshape(n_head, N, omega)
        top = torch.sort(tw, dim=-1, descending=True).values                    # pads sort last
        for q in range(n_head):
            for i in range(min(top_p, omega)):
                acc = acc + torch.where(i < cnt, top[q, :, i], torch.zeros((), dtype=torch.float64))
    return acc / (n_head * cnt).to(torch.float64)


def plan(obs: Observation, params: dict, budget: int) -> Plan:
    alpha, omega = params["window"], params["review_window"]
    if obs.n <= budget:
        return keep_all(obs)
    window = require_window(obs, "windowkv", alpha)
    L = obs.n - alpha                                                   # review context [0, L)
    gamma = group_size(obs.n_layer, params["shared_layers"])
    budgets = group_budgets(obs.n_layer, gamma, budget - alpha, params["beta"])
    N = -(-L // omega)
    kept: list = [None] * obs.n_layer
    for g, bud in enumerate(budgets):
        leader = g * gamma
        if L <= bud:
            review = torch.arange(L)
        else:
            t = window_sum(window[leader], L)                     # [n_head, L]
            s = window_scores(t, omega, params["top_p"], params["score"])
            keep_n = N - (-(-(L - bud) // omega))                        # N - ceil((L - bud) / omega)
            wins = topk_ascending(s, keep_n, "windowkv").tolist() if keep_n > 0 else []
            review = torch.cat([torch.arange(k * omega, min(L, (k + 1) * omega)) for k in wins]) \
                if wins else torch.zeros(0, dtype=torch.int64)
        group_kept = torch.cat([review, torch.arange(L, obs.n)])
        for l in range(leader, min(obs.n_layer, leader + gamma)):
            kept[l] = [group_kept] * obs.n_head_kv
    return plan_from_kept(kept)
