"""tova: its two planners (C++ and torch) give identical plans on random window attention (exact ties too); with
gqa=layer every KV head of a layer keeps the same slots, those the last query's attention averaged over all the
layer's query heads ranks first (kvpress TOVAPress's documented score, computed here in numpy); the last `window` slots
are always kept; the registry's checks."""
from __future__ import annotations

import numpy as np
import pytest
from policy_obs import assert_same, engine_plans, random_obs

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.native.lib import native_plan
from kvcli.reference.policies import reference_plan

SHAPES = [(5, 9, 3, 260), (4, 8, 2, 301), (3, 4, 4, 170), (6, 4, 1, 333), (1, 6, 2, 150)]
VARIANTS = [[], ["gqa=mean"], ["gqa=max", "window=8"], ["gqa=sum", "window=3"], ["window=16"]]


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_tova_planners_identical(ties):
    for si, (n_layer, n_head, n_head_kv, n) in enumerate(SHAPES):
        for vi, args in enumerate(VARIANTS):
            obs = random_obs(100 * si + 10 * vi, n_layer, n_head, n_head_kv, n, w=32, ties=ties)
            for budget in (40, 97):
                nat, ref = engine_plans("tova", args, budget, obs)
                assert_same(nat, ref)
                assert (nat.n_kept == budget).all()
                p = P.get("tova").validate(args)
                for l in range(n_layer):
                    for h in range(n_head_kv):
                        assert set(range(n - p["window"], n)) <= set(nat.kept(l, h).tolist())
                        if p["gqa"] == "layer":
                            assert np.array_equal(nat.kept(l, h), nat.kept(l, 0))


def test_tova_keeps_what_the_last_query_attends_to_most():
    """kvpress's TOVAPress: the last query's attention averaged over the heads, the last token kept."""
    obs = random_obs(4, 3, 6, 2, 140, w=32)
    last = obs.window_sum(1).astype(np.float64)          # [L, Hq, n]: the last query's attention
    for budget in (20, 64):
        nat, ref = engine_plans("tova", [], budget, obs)
        for l in range(3):
            score = last[l, :, :-1].mean(axis=0)
            want = set(np.argsort(-score, kind="stable")[: budget - 1].tolist()) | {obs.n - 1}
            for h in range(2):
                assert set(nat.kept(l, h).tolist()) == want and set(ref.kept(l, h).tolist()) == want


def test_tova_per_group_is_snapkv_without_pooling():
    obs = random_obs(5, 2, 6, 2, 150, w=32)
    a = engine_plans("tova", ["gqa=mean", "window=16"], 60, obs)[0]
    b = engine_plans("snapkv", ["window=16", "kernel=1"], 60, obs)[0]
    assert_same(a, b)


def test_tova_refusals_and_registry():
    with pytest.raises(KvcliError, match=r"budget 1 must be larger than window=1"):
        P.prepare("tova", [], 1)
    with pytest.raises(KvcliError, match=r"gqa must be one of layer, mean, max, sum"):
        P.prepare("tova", ["gqa=median"], 64)
    obs = random_obs(3, 2, 4, 2, 150, w=32)
    obs.window_sums[0, 1, 2, 10] = np.nan                 # window 1 (the first of the observed lengths)
    params = P.prepare("tova", [], 64)[1]
    with pytest.raises(KvcliError, match="NaN"):
        native_plan("tova", params, 64, obs)
    with pytest.raises(KvcliError, match="NaN"):
        reference_plan("tova", params, 64, obs)
    obs.window_sums, obs.windows = None, ()
    with pytest.raises(KvcliError, match="needs the window observation"):
        native_plan("tova", params, 64, obs)
    spec = P.get("tova")
    assert not spec.agnostic and spec.observe(spec.defaults()) == (("window",), 1)
