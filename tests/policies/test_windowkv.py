"""windowkv: whole review windows of `review_window` consecutive tokens, chosen once per group of layers by the
group's first layer (the leader) and kept by every layer and KV head of the group, plus the observation window.
Group review budgets follow the authors' code as the digest gives it (design/methods/windowkv.md §2.2 [C]):
G = ceil(n_layer / gamma) groups, b_last = B * gamma // lambda, b_first = 2B - b_last, a line with an integer step
between, B = budget - window; a group keeps N - ceil((L - b) / omega) of the N review windows of its leader's best
score (mean: over heads and tokens; topp: over heads of the mean of each head's top_p). Written here in numpy and
checked against both planners on random observations."""
from __future__ import annotations

import math

import numpy as np
import pytest
from policy_obs import engine_plans, random_obs

import kvcli.policies as P


def digest_group_budgets(n_layer: int, gamma: int, B: int, lam: int) -> list[int]:
    G = math.ceil(n_layer / gamma)
    if G == 1:
        return [B]
    b_last = B * gamma // lam
    b_first = 2 * B - b_last
    step = (b_first - b_last) // (G - 1)
    return [max(0, b_first - h * step) for h in range(G - 1)] + [max(0, b_last)]


def window_scores(t: np.ndarray, omega: int, score: str, top_p: int) -> np.ndarray:
    """t: [n_head, L] attention the review slots receive from the observation window -> one score per window."""
    L = t.shape[1]
    out = []
    for k in range(math.ceil(L / omega)):
        x = t[:, k * omega:(k + 1) * omega]
        out.append(x.mean() if score == "mean" else np.sort(x, axis=1)[:, ::-1][:, :top_p].mean())
    return np.array(out)


def expected_kept(obs, p: dict, budget: int) -> list[list[int]]:
    """Each layer's kept slots by the digest's rule."""
    alpha, omega = p["window"], p["review_window"]
    L, n_layer = obs.n - alpha, obs.n_layer
    gamma = p["shared_layers"]
    out = []
    for g, bud in enumerate(digest_group_budgets(n_layer, gamma, budget - alpha, p["beta"])):
        if L <= bud:
            review = list(range(L))
        else:
            t = obs.window_sum(alpha)[g * gamma, :, :L].astype(np.float64)
            s = window_scores(t, omega, p["score"], p["top_p"])
            keep = len(s) - math.ceil((L - bud) / omega)
            wins = sorted(np.argsort(-s, kind="stable")[:max(keep, 0)].tolist())
            review = [j for k in wins for j in range(k * omega, min(L, (k + 1) * omega))]
        out += [review + list(range(L, obs.n))] * len(range(g * gamma, min(n_layer, (g + 1) * gamma)))
    return out


CASES = [(8, 4, 2, 400, 128, ["shared_layers=2"]),
         (6, 6, 3, 333, 96, ["shared_layers=2", "task=aggregation", "review_window=8"]),
         (7, 4, 1, 290, 80, ["shared_layers=3", "score=topp", "top_p=3", "beta=4"]),
         (4, 2, 2, 260, 64, ["shared_layers=4", "review_window=5"])]


@pytest.mark.parametrize("n_layer,n_head,n_head_kv,n,budget,args", CASES)
def test_windowkv_groups_keep_their_leader_s_best_whole_windows(n_layer, n_head, n_head_kv, n, budget, args):
    p = P.prepare("windowkv", args, budget)[1]
    obs = random_obs(n + budget, n_layer, n_head, n_head_kv, n, w=32)
    want = expected_kept(obs, p, budget)
    for plan in engine_plans("windowkv", args, budget, obs):
        for l in range(n_layer):
            for h in range(n_head_kv):
                assert plan.kept(l, h).tolist() == want[l], (l, h)


def test_windowkv_group_budgets_fall_with_depth_and_layers_of_a_group_share_one_choice():
    n_layer, gamma, budget = 6, 2, 16 + 160
    obs = random_obs(9, n_layer, 4, 2, 16 + 16 * 40, w=32)
    plan = engine_plans("windowkv", [f"shared_layers={gamma}", "review_window=16", "beta=4"], budget, obs)[0]
    bg = digest_group_budgets(n_layer, gamma, budget - 16, 4)
    assert bg == [240, 160, 80]                        # b_last = 160 * 2 // 4, b_first = 2 * 160 - 80, step 80
    for g, b in enumerate(bg):                         # every window full (L and b multiples of omega): exact
        layers = range(g * gamma, (g + 1) * gamma)
        assert all(plan.n_kept[l, h] == b + 16 for l in layers for h in range(2))
        assert len({tuple(plan.kept(l, h).tolist()) for l in layers for h in range(2)}) == 1
    assert plan.n_kept.sum() == 2 * 2 * (240 + 160 + 80 + 3 * 16)   # the mean is the budget: B x n_layer + windows


def test_windowkv_the_task_picks_the_window_and_the_score():
    loc = P.prepare("windowkv", ["task=localization"], 128)[1]
    agg = P.prepare("windowkv", ["task=aggregation"], 128)[1]
    assert (loc["window"], loc["score"]) == (16, "mean") and (agg["window"], agg["score"]) == (32, "topp")
    assert agg["top_p"] == 8                               # review_window // 2
