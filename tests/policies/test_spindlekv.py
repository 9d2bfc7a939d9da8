"""spindlekv: the depth schedule against the digest's worked table, a hand-made codebook worked out here,
and the C++ and torch planners giving the same plan (identical cells, codebook rows within 1e-5) on
random observations.

Needs the native library with native/src/policies/spindlekv.cpp (python -m kvcli.native.build).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from policy_obs import assert_same, engine_plans, random_obs

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.native.lib import native_plan
from kvcli.planning.formats import Observation, sum_window_rows
from kvcli.policies.spindlekv import layer_keep
from kvcli.reference.policies import reference_plan


def both(args, budget, obs):
    """spindlekv's plan of `obs`, the same in both engines."""
    nat, ref = engine_plans("spindlekv", args, budget, obs)
    assert_same(nat, ref)
    return nat


# ---------------------------------------------------------------------------------------------
# schedule (Eq. 5-6)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("budget,k0,k15,k31", [
    (1600, 2784, 1630, 399),      # r = 0.2: r_c(0) = 2 r_c - 0.05, r_c(31) = 0.05
    (3200, 5984, 3282, 399),      # r = 0.4
    (5600, 7992, 5669, 3192),     # r = 0.7 > alpha: r_c(0) = 1, r_c(31) = 2 r_c - 1
])
def test_layer_keep_digest_table(budget, k0, k15, k31):
    """The digest's worked example: l = 8000, m = 32, l_w = 8."""
    k = layer_keep(32, 8000, budget, 8, 0.05, "uniform")
    assert (k[0], k[15], k[31]) == (k0, k15, k31)
    assert all(a >= b for a, b in zip(k, k[1:]))              # shallow layers keep more
    assert abs(sum(k) / 32 - (budget - 8)) < 1.0              # the mean is the context budget (floors)


def test_layer_keep_low_budget_fallbacks():
    # r_c = 248 / 7992 = 0.031 <= beta: undefined in the paper
    assert layer_keep(4, 8000, 256, 8, 0.05, "uniform") == [248] * 4
    k = layer_keep(4, 8000, 256, 8, 0.05, "shrink")           # 1.5 r_c ... 0.5 r_c
    assert k == [372, 289, 206, 124]
    assert layer_keep(1, 100, 50, 8, 0.05, "uniform") == [42]  # one layer: r_c itself


# ---------------------------------------------------------------------------------------------
# hand-made codebook
# ---------------------------------------------------------------------------------------------
def vec(deg, mag=1.0):
    return [mag * math.cos(math.radians(deg)), mag * math.sin(math.radians(deg))]


def handmade_obs():
    """One layer, one head, 10 slots, head_dim 2, window 2 (slots 8, 9), budget 8: the 6 best of slots
    0..7 stay, slots 2 and 6 (least attended) go. Keys of the kept slots (angle, magnitude):
    0: (0, 1), 1: (5, 2), 3: (10, 3) | 4: (60, 1), 5: (62, 3) | 7: (120, 1) | 8: (240, 1) | 9: (300, 1).
    With theta_k = 0.99 (8.1 degrees): 5 degrees is within reach of 0 and 10 (which are 10 apart), so the
    greedy cover picks slot 1 first (3 neighbours, itself included) -> {0, 1, 3}; then {4, 5} (slot 4:
    lower slot of the tie); then 7, 8, 9 alone. Evicted slots 2 (4 deg) and 6 (61 deg) would have merged."""
    k_angle = {0: (0, 1), 1: (5, 2), 2: (4, 1), 3: (10, 3), 4: (60, 1), 5: (62, 3), 6: (61, 1), 7: (120, 1),
               8: (240, 1), 9: (300, 1)}
    v_angle = {0: (0, 1), 1: (3, 2), 2: (0, 1), 3: (90, 1), 4: (0, 4), 5: (180, 1), 6: (0, 1), 7: (80, 2),
               8: (45, 1), 9: (270, 1)}
    keys = np.array([vec(*k_angle[j]) for j in range(10)], np.float32)[None, None]
    values = np.array([vec(*v_angle[j]) for j in range(10)], np.float32)[None, None]
    att = np.array([5, 4, 0.1, 3, 2, 1.5, 0.2, 1, 1, 1], np.float64)
    window = np.zeros((1, 1, 2, 10), np.float32)
    for r, q in enumerate((8, 9)):
        row = np.where(np.arange(10) <= q, att, 0)
        window[0, 0, r] = row / row.sum()
    return Observation(n_layer=1, n_head=1, n_head_kv=1, head_dim=2, n=10, window_sums=sum_window_rows(window, (2,)),
                       windows=(2,), keys=keys,
                       values=values, positions=np.arange(10, dtype=np.int32))


def test_handmade_codebook_worked_out():
    obs = handmade_obs()
    K, V = obs.keys[0, 0].astype(np.float64), obs.values[0, 0].astype(np.float64)

    plan = both(["window=2", "theta_k=0.99", "theta_v=1"], 8, obs)     # key codebook only
    assert plan.kept(0, 0).tolist() == [1, 4, 7, 8, 9]                   # cells at the exemplars
    np.testing.assert_allclose(plan.log_mult, np.log([3, 2, 1, 1, 1]), atol=1e-6)
    assert plan.replace_entry.tolist() == [0, 1]                        # the two merged cells
    np.testing.assert_allclose(plan.replace_k[0], np.array(vec(5)) * (1 + 2 + 3) / 3, atol=1e-6)
    np.testing.assert_allclose(plan.replace_k[1], np.array(vec(60)) * (1 + 3) / 2, atol=1e-6)
    np.testing.assert_allclose(plan.replace_v[0], (V[0] + V[1] + V[3]) / 3, atol=1e-6)
    np.testing.assert_allclose(plan.replace_v[1], (V[4] + V[5]) / 2, atol=1e-6)

    # value codebook too (theta_v = 0.95, 18.2 degrees): values at 0, 3 and 0 degrees (slots 0, 1, 4)
    # form one group with exemplar slot 0; 90 and 80 (slots 3, 7) one with exemplar slot 3. Each value
    # is rebuilt as unit(exemplar) x its own magnitude: slot 1 -> (2, 0), slot 7 -> (0, 2).
    plan = both(["window=2", "theta_k=0.99"], 8, obs)
    assert plan.kept(0, 0).tolist() == [1, 4, 7, 8, 9]
    assert plan.replace_entry.tolist() == [0, 1, 2]                     # slot 7's value is quantised
    np.testing.assert_allclose(plan.replace_v[0], (np.array([1, 0]) + np.array([2, 0]) + V[3]) / 3, atol=1e-6)
    np.testing.assert_allclose(plan.replace_v[1], (np.array([4, 0]) + V[5]) / 2, atol=1e-6)
    np.testing.assert_allclose(plan.replace_k[2], K[7], atol=0)        # a singleton keeps its own key
    np.testing.assert_allclose(plan.replace_v[2], [0, 2], atol=1e-6)

    plan = both(["window=2", "theta_k=0.99", "theta_v=1", "k_scale=exemplar"], 8, obs)
    np.testing.assert_allclose(plan.replace_k[0], K[1], atol=0)

    plan = both(["window=2", "theta_k=1", "theta_v=1"], 8, obs)         # eviction only
    assert plan.kept(0, 0).tolist() == [0, 1, 3, 4, 5, 7, 8, 9] and plan.replace_entry.size == 0
    assert not plan.log_mult.any()


def test_codebook_layers_limits_merging_to_shallow_layers():
    obs = random_obs(4, 4, 6, 2, 200, head_dim=4, kv=True)
    plan = both(["theta_k=0.5", "theta_v=0.5", "codebook_layers=2"], 64, obs)
    lm = plan.log_mult
    off = plan.offsets()
    deep = np.concatenate([lm[off[l, h]: off[l, h] + plan.n_kept[l, h]] for l in (2, 3) for h in range(2)])
    shallow = np.concatenate([lm[off[l, h]: off[l, h] + plan.n_kept[l, h]] for l in (0, 1) for h in range(2)])
    assert not deep.any() and shallow.max() > 0
    assert (plan.replace_entry < off[2, 0]).all()


# ---------------------------------------------------------------------------------------------
# C++ vs torch on random observations
# ---------------------------------------------------------------------------------------------
SHAPES = [(5, 9, 3, 260), (4, 8, 2, 301), (3, 4, 4, 170), (2, 4, 1, 333)]
VARIANTS = [[], ["theta_k=0.3", "theta_v=0.2", "fill_heads=off"],
            ["theta_k=0.1", "theta_v=1", "k_scale=exemplar", "gqa=max"],
            ["score_norm=causal_count", "kernel=5", "pool=avg", "theta_k=0.5", "low_budget=shrink"],
            ["window=16", "beta=0.2", "theta_k=0.4", "theta_v=0.4", "codebook_layers=1"]]


@pytest.mark.parametrize("vi", range(len(VARIANTS)))
def test_engines_agree_on_random_observations(vi):
    for si, (n_layer, n_head, n_head_kv, n) in enumerate(SHAPES):
        obs = random_obs(10 * si + vi, n_layer, n_head, n_head_kv, n, w=32, kv=True, ties=si == 3, head_dim=4)
        for budget in (40, 97):
            plan = both(VARIANTS[vi], budget, obs)
            assert plan.entries() < n_layer * n_head_kv * n
            # every kept entry is accounted for: the cells' multiplicities add up to the eviction budget
            keep = layer_keep(n_layer, n, budget, P.prepare("spindlekv", VARIANTS[vi], budget)[1]["window"],
                              P.prepare("spindlekv", VARIANTS[vi], budget)[1]["beta"],
                              P.prepare("spindlekv", VARIANTS[vi], budget)[1]["low_budget"])
            w = P.prepare("spindlekv", VARIANTS[vi], budget)[1]["window"]
            total = round(float(np.exp(plan.log_mult.astype(np.float64)).sum()))
            if "fill_heads=off" in VARIANTS[vi]:
                assert total == n_head_kv * (sum(keep) + n_layer * w)
            else:   # heads that merged more keep their next-best entries: every head as wide as its layer's widest,
                # unless the layer kept every context entry already (nothing left to fill with)
                prefix = n - w
                assert all((plan.n_kept[l] == plan.n_kept[l].max()).all() or keep[l] >= prefix for l in range(n_layer))
                assert any(k < prefix for k in keep)
                assert total >= n_head_kv * (sum(keep) + n_layer * w)


def test_short_prompt_is_kept_whole():
    obs = random_obs(2, 3, 6, 2, 50, kv=True)
    plan = both([], 64, obs)
    assert (plan.n_kept == 50).all() and plan.log_mult is None


def test_errors_are_clear_in_both_engines():
    obs = random_obs(3, 3, 4, 2, 150, w=32, kv=True)
    _, params, _ = P.prepare("spindlekv", [], 64)
    obs.values = None
    for run in (lambda: native_plan("spindlekv", params, 64, obs),
                lambda: reference_plan("spindlekv", params, 64, obs)):
        with pytest.raises(KvcliError, match="needs the kv observation"):
            run()
    with pytest.raises(KvcliError, match="budget 8 must be larger than window=8"):
        P.prepare("spindlekv", [], 8)
    with pytest.raises(KvcliError, match="budget 8 must be larger than window=8"):
        reference_plan("spindlekv", params, 8, obs)   # the registry's check, the one both engines' callers run


def test_explain_documents_the_storage_and_every_reconstruction_choice():
    text = P.explain_text("spindlekv")
    assert "bias log(count)" in text and "post-RoPE" in text and "achieved ratio" in text
    for p in ("score_norm", "low_budget", "theta_k", "theta_v", "k_scale", "codebook_layers", "gqa", "window"):
        assert f"  {p} = " in text


# ---------------------------------------------------------------------------------------------
# the codebook in the real native cache: fewer cells, measured bytes
# ---------------------------------------------------------------------------------------------
from test_d2o import compress_in_native_cache  # noqa: E402


def test_codebook_cells_shrink_the_native_cache(tiny_session):
    evict, s_evict = compress_in_native_cache(tiny_session, "spindlekv", ["theta_k=1", "theta_v=1"])
    merged, s_merged = compress_in_native_cache(tiny_session, "spindlekv", ["theta_k=0.6"])
    assert merged.replace_entry.size > 0 and merged.entries() < evict.entries()
    # the bytes are measured from the cache: a cell per codebook group of the widest head
    assert s_merged["kv_cells"] < s_evict["kv_cells"]
    assert s_merged["kv_bytes"] * s_evict["kv_cells"] == s_evict["kv_bytes"] * s_merged["kv_cells"]
