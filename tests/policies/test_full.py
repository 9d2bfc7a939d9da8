"""full: no compression, the baseline every policy is measured against. Both planners keep every entry of every
layer and KV head whatever the budget and the observation; it takes no argument and no budget; and its plan applied
to a tiny random model's cache changes nothing: the rows and the next token's logits stay those of the plain
prefill."""
from __future__ import annotations

import numpy as np
import pytest
from policy_obs import engine_plans, random_obs

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation


def test_full_keeps_every_entry_whatever_the_budget():
    for obs in (random_obs(1, 3, 6, 2, 150, kv=True), Observation(n_layer=2, n_head=4, n_head_kv=4, head_dim=8, n=70)):
        for budget in (1, 10, obs.n, 10 * obs.n):
            for plan in engine_plans("full", [], budget, obs):
                assert (plan.n_kept == obs.n).all()
                assert all(plan.kept(l, h).tolist() == list(range(obs.n))
                           for l in range(obs.n_layer) for h in range(obs.n_head_kv))
                assert plan.replace_entry.size == 0


def test_full_takes_no_argument_and_no_budget():
    spec, params = P.choose("full", None)
    assert spec.name == "full" and params == {} and spec.needs == () and spec.observe(params) == ((), 0)
    assert P.choose("full", 64)[1] == {}                  # a budget is ignored
    with pytest.raises(KvcliError, match="takes no --policy-arg"):
        P.choose("full", None, {"window": 8})


def test_full_plan_leaves_a_tiny_model_s_cache_as_it_was(tiny_session):
    from kvcli.native import cache
    from kvcli.native.lib import native_plan
    s = tiny_session
    toks = [int(t) for t in np.random.default_rng(14).integers(300, 5000, size=120)]
    s.clear()
    s.prefill(toks)
    k0, v0 = cache.read_kv(s.ctx, 0, s.info)
    s.step({0: 1000})
    want = np.array(s.logits(), copy=True)
    s.clear()
    obs = s.prefill(toks, observe=("kv",))
    plan = native_plan("full", {}, 16, obs)
    s.apply_plan(plan)
    k, v = cache.read_kv(s.ctx, 0, s.info)
    assert s.stats()["kv_cells"] == 120
    np.testing.assert_array_equal(k, k0)
    np.testing.assert_array_equal(v, v0)
    s.step({0: 1000})
    np.testing.assert_allclose(s.logits(), want, rtol=0, atol=1e-5)
