"""h2o (prefill variant): per KV head, the (budget - recent) prefix slots with the highest attention accumulated over
every prompt query (the colsum observation, the group's query heads combined by `gqa`), plus the last `recent`
slots. Checked against that rule written here in numpy, on synthetic column sums and on a tiny random model's."""
from __future__ import annotations

import numpy as np
import pytest
from policy_obs import engine_plans, np_group, np_top, random_obs

import kvcli.policies as P

VARIANTS = [[], ["recent=1"], ["recent=8", "gqa=max"], ["recent=4", "gqa=sum"]]


@pytest.mark.parametrize("args", VARIANTS, ids=lambda a: ",".join(a) or "defaults")
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_h2o_keeps_the_recent_slots_and_the_heaviest_hitters(args, ties):
    p = P.get("h2o").validate(args)
    r = p["recent"]
    for seed, (n_layer, n_head, n_head_kv, n) in enumerate([(2, 6, 2, 200), (3, 4, 4, 131), (1, 8, 1, 90)]):
        obs = random_obs(seed, n_layer, n_head, n_head_kv, n, ties=ties)
        for budget in (r + 1, 70):
            nat, ref = engine_plans("h2o", args, budget, obs)
            assert (nat.n_kept == budget).all()
            for l in range(n_layer):
                scores = np_group(obs.colsum[l, :, : n - r].astype(np.float64), n_head_kv, p["gqa"])
                for h in range(n_head_kv):
                    want = np_top(scores[h], budget - r) + list(range(n - r, n))
                    assert nat.kept(l, h).tolist() == want and ref.kept(l, h).tolist() == want


def test_h2o_scores_every_query_not_the_window():
    """Two observations alike in their window attention, one slot made heavy in the column sums only: h2o keeps it
    (snapkv, which reads the window, does not move); a slot made light there is dropped."""
    obs = random_obs(5, n_layer=1, n_head=2, n_head_kv=1, n=150)
    base = engine_plans("h2o", ["recent=8"], 40, obs)[0].kept(0, 0).tolist()
    snap = engine_plans("snapkv", ["window=8"], 40, obs)[0].kept(0, 0).tolist()
    heavy = next(j for j in range(10, 100) if j not in base)
    light = base[0]
    obs.colsum = obs.colsum.copy()
    obs.colsum[0, :, heavy] = obs.colsum.max() + 1.0
    obs.colsum[0, :, light] = 0.0
    for plan in engine_plans("h2o", ["recent=8"], 40, obs):
        kept = plan.kept(0, 0).tolist()
        assert heavy in kept and light not in kept
        assert set(kept) - {heavy} == set(base) - {light}
    assert engine_plans("snapkv", ["window=8"], 40, obs)[0].kept(0, 0).tolist() == snap


def test_h2o_on_a_tiny_model_follows_its_own_column_sums(tiny_session):
    from kvcli.native.lib import native_plan
    s = tiny_session
    s.clear()
    toks = [int(t) for t in np.random.default_rng(12).integers(300, 5000, size=150)]
    spec, params, _ = P.prepare("h2o", ["recent=8"], 32)
    kinds, w = spec.observe(params)
    assert kinds == ("colsum",)
    obs = s.prefill(toks, observe=kinds, window=w)
    assert obs.colsum.shape == (3, 4, 150) and np.all(obs.colsum >= 0)
    plan = native_plan("h2o", params, 32, obs)
    for l in range(3):
        scores = np_group(obs.colsum[l, :, :142].astype(np.float64), 2, "mean")
        for h in range(2):
            assert plan.kept(l, h).tolist() == np_top(scores[h], 24) + list(range(142, 150))
    s.apply_plan(plan)
    assert s.stats()["per_head_entries"] == [[32, 32]] * 3
