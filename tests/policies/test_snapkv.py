"""snapkv: per KV head, the (budget - window) prefix slots the last `window` queries attend to most (pooled,
the group's query heads combined by `gqa`), plus the window itself; the same budget in every layer. The kept sets
of both planners are checked against that rule written here in numpy, and on a tiny random model's own
observation, whose compressed cache then holds those rows."""
from __future__ import annotations

import numpy as np
import pytest
from policy_obs import engine_plans, np_snap_scores, np_top, random_obs

import kvcli.policies as P

VARIANTS = [[], ["window=8", "kernel=1"], ["window=16", "kernel=5", "pool=avg"], ["window=4", "gqa=max"],
            ["window=8", "kernel=3", "gqa=sum"]]


@pytest.mark.parametrize("args", VARIANTS, ids=lambda a: ",".join(a) or "defaults")
def test_snapkv_keeps_the_window_and_the_top_pooled_window_attention(args):
    p = P.get("snapkv").validate(args)
    w = p["window"]
    for seed, (n_layer, n_head, n_head_kv, n) in enumerate([(2, 6, 2, 200), (3, 4, 4, 131), (1, 8, 1, 90)]):
        obs = random_obs(seed, n_layer, n_head, n_head_kv, n, w=32)
        for budget in (w + 1, 60):
            nat, ref = engine_plans("snapkv", args, budget, obs)
            assert (nat.n_kept == budget).all()                      # every layer the same budget
            for l in range(n_layer):
                scores = np_snap_scores(obs, l, w, p["kernel"], p["pool"], p["gqa"])
                for h in range(n_head_kv):
                    want = np_top(scores[h], budget - w) + list(range(n - w, n))
                    assert nat.kept(l, h).tolist() == want and ref.kept(l, h).tolist() == want


def test_snapkv_a_slot_the_window_attends_to_is_kept_only_in_its_own_group():
    """Attention poured on one slot by the query heads of KV head 1 only: kept there, not by KV head 0."""
    obs = random_obs(3, n_layer=1, n_head=4, n_head_kv=2, n=120, w=32)
    slot = 40
    sums = obs.window_sums.copy()
    sums[:, 0, 2:4, slot] += 50.0                             # every window length, query heads 2 and 3
    obs.window_sums = sums
    nat, ref = engine_plans("snapkv", ["window=8", "kernel=1"], 12, obs)
    base = engine_plans("snapkv", ["window=8", "kernel=1"], 12, random_obs(3, 1, 4, 2, 120, w=32))[0]
    for plan in (nat, ref):
        assert slot in plan.kept(0, 1).tolist()
        assert plan.kept(0, 0).tolist() == base.kept(0, 0).tolist()


def test_snapkv_on_a_tiny_model_keeps_the_rows_its_observation_ranks_first(tiny_session):
    from kvcli.native import cache
    from kvcli.native.lib import native_plan
    s = tiny_session
    s.clear()
    toks = [int(t) for t in np.random.default_rng(11).integers(300, 5000, size=160)]
    spec, params, _ = P.prepare("snapkv", ["window=8"], 40)
    kinds, w = spec.observe(params)
    obs = s.prefill(toks, observe=(*kinds, "kv"), window=w)
    whole = obs.with_kv_arrays()
    plan = native_plan("snapkv", params, 40, obs)
    s.apply_plan(plan)
    k, v = cache.read_kv(s.ctx, 0, s.info)
    assert s.stats()["kv_cells"] == 40 and k.shape[2] == 40
    for l in range(obs.n_layer):
        scores = np_snap_scores(obs, l, 8, params["kernel"], params["pool"], params["gqa"])
        for h in range(obs.n_head_kv):
            want = np_top(scores[h], 32) + list(range(152, 160))
            assert plan.kept(l, h).tolist() == want
            np.testing.assert_array_equal(k[l, h], whole.keys[l, h, want])
            np.testing.assert_array_equal(v[l, h], whole.values[l, h, want])
