"""dynamickv: SnapKV's pooled window scores per layer, and per-layer budgets from a progressive global top-k
(design/methods/dynamickv.md §2.3): every `interval` layers (and, kvcli's deviation, at the last) the
base x n_head_kv x (l + 1) best scores of the layers seen so far are counted per layer; those counts (floored by
l + 1, the last update's rounding fix-up), scaled to B_max = min(r_max x base, n - window) and renormalised to the
total base x n_layer, become the layers' budgets, which only shrink. The rule is written here in numpy from the
digest's pseudocode and checked against both planners on random observations."""
from __future__ import annotations

import math

import numpy as np
import pytest
from policy_obs import engine_plans, np_snap_scores, np_top, random_obs

import kvcli.policies as P


def digest_budgets(obs, p: dict, budget: int) -> tuple[list[int], list[np.ndarray]]:
    """The prefix entries each layer keeps per KV head, and each layer's scores [n_head_kv, P]."""
    ws, m, L, H = p["window"], p["interval"], obs.n_layer, obs.n_head_kv
    P_ = obs.n - ws
    base = budget - ws
    bmax = min(int(p["r_max"] * base), P_)
    total = base * L
    scores, cur = [], []
    for l in range(L):
        scores.append(np_snap_scores(obs, l, ws, p["kernel"], p["pool"], p["gqa"]))
        cur.append(bmax)
        if l % m != m - 1 and l != L - 1:
            continue
        n_seen = l + 1
        flat = np.stack(scores).reshape(-1)
        top = np.argsort(-flat, kind="stable")[:min(base * H * n_seen, flat.size)]
        c = (np.bincount(top // (H * P_), minlength=n_seen) // n_seen).tolist()
        if l == L - 1:
            c[l] += base * H - sum(c)
        if sum(c) <= 0:
            continue
        Z = [int(bmax * (cj / sum(c))) for cj in c]
        if sum(Z) <= 0:
            continue
        r = sum(Z) / total
        Zp = [math.floor(z / r) for z in Z]
        Zp[l] += total - sum(Zp)
        cur = [min(cur[j], Zp[j], P_) for j in range(n_seen)] + cur[n_seen:]
    return cur, scores


CASES = [(8, 4, 2, 300, 64, []), (7, 6, 3, 250, 40, ["interval=3"]), (5, 4, 1, 400, 72, ["interval=1", "r_max=2"]),
         (6, 4, 4, 220, 48, ["window=16", "pool=max", "gqa=max"])]


@pytest.mark.parametrize("n_layer,n_head,n_head_kv,n,budget,args", CASES)
def test_dynamickv_layer_budgets_follow_the_progressive_global_top_k(n_layer, n_head, n_head_kv, n, budget, args):
    p = P.get("dynamickv").validate(args)
    ws = p["window"]
    obs = random_obs(n_layer * 100 + budget, n_layer, n_head, n_head_kv, n, w=32)
    budgets, scores = digest_budgets(obs, p, budget)
    for plan in engine_plans("dynamickv", args, budget, obs):
        assert plan.n_kept.tolist() == [[b + ws] * n_head_kv for b in budgets]
        for l in range(n_layer):
            for h in range(n_head_kv):
                assert plan.kept(l, h).tolist() == np_top(scores[l][h], budgets[l]) + list(range(n - ws, n))
    assert sum(budgets) <= (budget - ws) * n_layer and len(set(budgets)) > 1


def test_dynamickv_gives_the_budget_to_the_layers_whose_scores_win_the_global_top_k():
    """Layers whose window attention is concentrated on few slots win the global top-k's counts and keep more than
    the layers whose attention is spread thin."""
    obs = random_obs(3, n_layer=4, n_head=2, n_head_kv=1, n=300, w=32)
    sums = obs.window_sums.astype(np.float64)
    sums[:, 2:] *= 0.05                                      # layers 2 and 3: little attention on the prefix
    obs.window_sums = sums.astype(np.float32)
    for plan in engine_plans("dynamickv", ["interval=2"], 40, obs):
        kept = plan.n_kept[:, 0]
        assert kept[:2].min() > kept[2:].max()
        assert kept.sum() <= 40 * 4
