"""keydiff: its two planners (C++ and torch) give identical plans on random keys (exact ties too); both keep what the
documented formula (kvpress KeyDiffPress: -cos(k, mean of the normalised keys)) ranks first, computed here in numpy on
small tensors; the last `recent` slots are always kept; the registry's checks."""
from __future__ import annotations

import numpy as np
import pytest
from policy_obs import assert_same, engine_plans

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.native.lib import native_plan
from kvcli.planning.formats import Observation
from kvcli.reference.policies import reference_plan

SHAPES = [(3, 9, 3, 16, 260), (2, 8, 2, 8, 301), (2, 4, 4, 64, 170), (1, 6, 1, 8, 150)]   # L, Hq, Hkv, d, n
VARIANTS = [[], ["recent=0"], ["recent=31"]]


def key_obs(seed, n_layer, n_head, n_head_kv, d, n, ties=False, zeros=False) -> Observation:
    rng = np.random.default_rng(seed)
    keys = (rng.standard_normal((n_layer, n_head_kv, n, d)) + rng.standard_normal((n_layer, n_head_kv, 1, d)))
    if ties:   # few distinct keys: exact ties of the score inside each head
        keys = keys[:, :, rng.integers(0, 7, size=n)]
    keys = keys.astype(np.float32)
    if zeros:
        keys[:, :, 5::17] = 0.0
    values = rng.standard_normal((n_layer, n_head_kv, n, d)).astype(np.float32)
    return Observation(n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=d, n=n, keys=keys, values=values,
                       positions=np.arange(n, dtype=np.int32))


def formula_kept(keys: np.ndarray, budget: int, recent: int) -> set[int]:
    """KeyDiffPress's score written from its documentation: anchor = mean of the L2-normalised keys, score =
    -cosine(key, anchor); the (budget - recent) best of the slots before the recent ones, plus those."""
    k = keys.astype(np.float64)
    unit = k / np.maximum(np.linalg.norm(k, axis=-1, keepdims=True), 1e-12)
    anchor = unit.mean(axis=0)
    score = -(unit @ anchor) / np.linalg.norm(anchor)
    n = len(k)
    order = np.argsort(-score[: n - recent], kind="stable")
    return set(order[: budget - recent].tolist()) | set(range(n - recent, n))


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_keydiff_planners_identical(ties):
    for si, shape in enumerate(SHAPES):
        for vi, args in enumerate(VARIANTS):
            obs = key_obs(10 * si + vi, *shape, ties=ties, zeros=vi == 2)
            for budget in (40, 97):
                nat, ref = engine_plans("keydiff", args, budget, obs)
                assert_same(nat, ref)
                assert (nat.n_kept == budget).all()
                r = P.get("keydiff").validate(args)["recent"]
                for lst in nat.kept_lists():
                    for k in lst:
                        assert set(range(obs.n - r, obs.n)) <= set(k.tolist())


@pytest.mark.parametrize("recent", [0, 8])
def test_keydiff_keeps_what_the_documented_formula_ranks_first(recent):
    obs = key_obs(7, 2, 6, 2, 32, 120)
    for budget in (20, 60):
        nat, ref = engine_plans("keydiff", [f"recent={recent}"], budget, obs)
        for l in range(2):
            for h in range(2):
                want = formula_kept(obs.keys[l, h], budget, recent)
                assert set(nat.kept(l, h).tolist()) == want
                assert set(ref.kept(l, h).tolist()) == want


def test_keydiff_keeps_the_outlier_keys():
    """Keys along one direction and a few pointing elsewhere: the few are the least like the mean, kept first."""
    rng = np.random.default_rng(0)
    n, d = 100, 8
    keys = np.tile(np.eye(d, dtype=np.float32)[0], (n, 1)) * rng.uniform(0.5, 2.0, (n, 1)).astype(np.float32)
    keys += 0.01 * rng.standard_normal((n, d)).astype(np.float32)
    odd = [3, 40, 77]
    keys[odd] = np.eye(d, dtype=np.float32)[[1, 2, 3]]
    obs = Observation(n_layer=1, n_head=2, n_head_kv=1, head_dim=d, n=n, keys=keys[None, None].copy(),
                      values=keys[None, None].copy(), positions=np.arange(n, dtype=np.int32))
    nat, ref = engine_plans("keydiff", ["recent=0"], 3, obs)
    assert nat.kept(0, 0).tolist() == odd and ref.kept(0, 0).tolist() == odd


def test_keydiff_short_prompt_kept_whole_and_refusals():
    obs = key_obs(1, 2, 4, 2, 8, 50)
    nat, ref = engine_plans("keydiff", [], 64, obs)
    assert (nat.n_kept == 50).all() and (ref.n_kept == 50).all()
    with pytest.raises(KvcliError, match=r"budget 8 must be larger than recent=8"):
        P.prepare("keydiff", [], 8)
    obs = key_obs(1, 2, 4, 2, 8, 150)
    obs.keys[1, 0, 3, 2] = np.nan
    params = P.prepare("keydiff", [], 64)[1]
    with pytest.raises(KvcliError, match="NaN"):
        native_plan("keydiff", params, 64, obs)
    with pytest.raises(KvcliError, match="NaN"):
        reference_plan("keydiff", params, 64, obs)
    obs.keys = obs.values = None
    with pytest.raises(KvcliError, match="needs the kv observation"):
        native_plan("keydiff", params, 64, obs)
    with pytest.raises(KvcliError, match="needs the kv observation"):
        reference_plan("keydiff", params, 64, obs)


def test_keydiff_registry_entry():
    spec = P.get("keydiff")
    assert spec.agnostic and spec.needs == ("kv",) and spec.observe(spec.defaults()) == (("kv",), 0)
    assert "kvpress" in spec.explain() and "recent=0 reproduces it" in spec.explain()
