"""pyramidkv: SnapKV's selection with per-layer budgets on a line that falls with depth (KVCache-Factory's shape:
the lowest layer 2 x base - base // beta prefix entries, the top layer base // beta, base = budget - window). With
the default schedule=exact the layers keep budget x n_layer entries in all. Checked on random observations in both
planners: the counts the plans keep, and each layer's kept set against SnapKV's score in numpy at that layer's
budget."""
from __future__ import annotations

import numpy as np
import pytest
from policy_obs import engine_plans, np_snap_scores, np_top, random_obs

import kvcli.policies as P

CASES = [(8, 2, 1, 1200, 128, []), (6, 6, 2, 700, 96, ["window=16", "beta=4"]),
         (12, 4, 4, 900, 64, ["beta=8", "kernel=3", "pool=avg"]), (5, 4, 2, 500, 100, ["gqa=max"])]


@pytest.mark.parametrize("n_layer,n_head,n_head_kv,n,budget,args", CASES)
def test_pyramidkv_budgets_fall_with_depth_and_sum_to_the_budget(n_layer, n_head, n_head_kv, n, budget, args):
    p = P.get("pyramidkv").validate(args)
    w, base = p["window"], budget - p["window"]
    obs = random_obs(n_layer * n, n_layer, n_head, n_head_kv, n, w=32)
    nat, ref = engine_plans("pyramidkv", args, budget, obs)
    assert np.array_equal(nat.n_kept, ref.n_kept)
    per_layer = nat.n_kept[:, 0]
    assert (nat.n_kept == per_layer[:, None]).all()                  # every KV head of a layer alike
    assert all(a >= b for a, b in zip(per_layer, per_layer[1:])) and per_layer[0] > per_layer[-1]
    assert int(per_layer.sum()) == budget * n_layer                  # the mean is the budget
    lo, hi = base // p["beta"], 2 * base - base // p["beta"]
    assert abs(int(per_layer[-1]) - w - lo) <= 1 and abs(int(per_layer[0]) - w - hi) <= 1   # the line's ends
    for l in range(n_layer):                                         # SnapKV's choice at the layer's budget
        scores = np_snap_scores(obs, l, w, p["kernel"], p["pool"], p["gqa"])
        for h in range(n_head_kv):
            want = np_top(scores[h], int(per_layer[l]) - w) + list(range(n - w, n))
            assert nat.kept(l, h).tolist() == want and ref.kept(l, h).tolist() == want


def test_pyramidkv_layer_is_snapkv_at_its_own_budget():
    obs = random_obs(21, n_layer=4, n_head=4, n_head_kv=2, n=800, w=32)
    plan = engine_plans("pyramidkv", [], 128, obs)[0]
    for l in (0, 3):
        b = int(plan.n_kept[l, 0])
        snap = engine_plans("snapkv", ["window=8"], b, obs)[0]     # pyramidkv's window, kernel and pool
        assert plan.kept(l, 0).tolist() == snap.kept(l, 0).tolist()


def test_pyramidkv_middle_length_prompts_get_uniform_budgets():
    """n < 2 x base: KVCache-Factory's middle branch, SnapKV's uniform budget."""
    obs = random_obs(2, n_layer=6, n_head=2, n_head_kv=1, n=200, w=32)
    for plan in engine_plans("pyramidkv", [], 120, obs):
        assert (plan.n_kept == 120).all()
