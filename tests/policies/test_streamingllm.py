"""streamingllm: the first `sinks` slots (attention sinks) and the most recent (budget - sinks), the same in every
layer and KV head, whatever the attention: it observes nothing. On shapes alone in both planners, and in a tiny
random model's cache, which then holds exactly those rows."""
from __future__ import annotations

import numpy as np
import pytest
from policy_obs import engine_plans, random_obs

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation


@pytest.mark.parametrize("sinks", [0, 1, 4, 16])
def test_streamingllm_keeps_the_sinks_and_the_most_recent_entries(sinks):
    for n_layer, n_head, n_head_kv, n in [(2, 4, 2, 100), (3, 6, 3, 257), (1, 2, 1, 40)]:
        obs = Observation(n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=8, n=n)
        for budget in (sinks + 1, sinks + 7, n - 1):
            want = list(range(sinks)) + list(range(n - (budget - sinks), n))
            for plan in engine_plans("streamingllm", [f"sinks={sinks}"], budget, obs):
                assert all(plan.kept(l, h).tolist() == want for l in range(n_layer) for h in range(n_head_kv))


def test_streamingllm_ignores_the_attention():
    """Observed or not, whatever the attention: the same plan."""
    shapes = Observation(n_layer=3, n_head=6, n_head_kv=2, head_dim=8, n=200)
    plan = engine_plans("streamingllm", [], 50, shapes)[0]
    for seed in range(3):
        for other in engine_plans("streamingllm", [], 50, random_obs(seed, 3, 6, 2, 200, kv=True)):
            assert np.array_equal(other.slots, plan.slots) and np.array_equal(other.n_kept, plan.n_kept)
    spec = P.get("streamingllm")
    assert spec.needs == () and spec.observe(spec.defaults())[0] == ()


def test_streamingllm_short_prompt_whole_and_budget_above_sinks():
    obs = Observation(n_layer=2, n_head=2, n_head_kv=1, head_dim=8, n=30)
    for plan in engine_plans("streamingllm", [], 30, obs):
        assert plan.kept(1, 0).tolist() == list(range(30))
    with pytest.raises(KvcliError, match="sinks"):
        P.prepare("streamingllm", ["sinks=8"], 8)


def test_streamingllm_in_a_tiny_model_s_cache(tiny_session):
    from kvcli.drivers.compress import prefill_and_compress, resolve
    from kvcli.native import cache
    s = tiny_session
    s.clear()
    toks = [int(t) for t in np.random.default_rng(13).integers(300, 5000, size=150)]
    whole = s.prefill(toks, observe=("kv",)).with_kv_arrays()
    s.clear()
    rep = prefill_and_compress(s, toks, resolve(s.model_path, "streamingllm", 24,
                                                 P.get("streamingllm").validate(["sinks=4"])))
    want = list(range(4)) + list(range(130, 150))
    assert rep.plan.kept(2, 1).tolist() == want
    k, v = cache.read_kv(s.ctx, 0, s.info)
    assert k.shape == (3, 2, 24, 16)
    np.testing.assert_array_equal(k, whole.keys[:, :, want])
    np.testing.assert_array_equal(v, whole.values[:, :, want])
    s.step({0: 1000})                                    # decoding goes on after the sinks and the recent entries
    assert np.isfinite(s.logits()).all()
