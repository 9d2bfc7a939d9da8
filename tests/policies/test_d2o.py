"""d2o: the layer schedule against worked numbers, a hand-made merge worked out here, and the C++ and
torch planners giving the same plan (identical kept sets, merged rows within 1e-5) on random observations.

Needs the native library with native/src/policies/d2o.cpp (python -m kvcli.native.build).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from policy_obs import assert_same, engine_plans, random_obs

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.native.lib import native_plan
from kvcli.planning.formats import Observation
from kvcli.policies.d2o import layer_budgets, layer_weights, split
from kvcli.reference.policies import reference_plan


def both(args, budget, obs):
    """d2o's plan of `obs`, the same in both engines."""
    nat, ref = engine_plans("d2o", args, budget, obs)
    assert_same(nat, ref)
    return nat


# ---------------------------------------------------------------------------------------------
# schedule
# ---------------------------------------------------------------------------------------------
def test_layer_weights_follow_the_papers_rules():
    s2 = [0.5, 1.0, 100.0, 100.0]
    w = layer_weights(s2, [], "softmax_inv_var")            # exp(1/s2 - max) = exp(0), exp(-1), exp(-1.99) x2
    assert w == pytest.approx([1.0, math.exp(-1), math.exp(-1.99), math.exp(-1.99)])
    assert layer_weights(s2, [], "inv_var") == pytest.approx([2.0, 1.0, 0.01, 0.01])
    assert layer_weights(s2, [], "exp_decay") == pytest.approx([1.0, math.exp(-0.5), math.exp(-99.5), math.exp(-99.5)])
    assert layer_weights(s2, [], "uniform") == [1.0] * 4
    # code: per layer, head variances min-max normalised then averaged; softmax of minus that
    hv = [[1.0, 3.0], [2.0, 2.0], [0.0, 1.0, 4.0]]          # normalised means 0.5, 0, (0 + .25 + 1)/3
    assert layer_weights([0, 0, 0], hv, "code") == pytest.approx([math.exp(-0.5), 1.0, math.exp(-1.25 / 3)])


def test_layer_budgets_water_filling_worked_example():
    # shares 0.609, 0.224, 0.083, 0.083 of 40: layer 0 would get 24.4 > 20 -> pinned at 20; the other
    # 20 go 20 * (0.3679, 0.1367, 0.1367) / 0.6413 = 11.47, 4.26, 4.26 -> floors 11, 4, 4, +1 to layer 1
    w = layer_weights([0.5, 1.0, 100.0, 100.0], [], "softmax_inv_var")
    assert layer_budgets(w, 40, 1, 20) == [20, 12, 4, 4]
    # the floor: a tiny share is lifted to lo and the others pay for it
    assert layer_budgets([1.0, 1.0, 1e-9], 30, 5, 100) == [13, 12, 5]
    assert layer_budgets([1.0, 1.0, 1.0], 30, 1, 100) == [10, 10, 10]
    assert sum(layer_budgets([0.3, 0.2, 0.9, 1e-3, 5.0], 333, 7, 90)) == 333


def test_split_is_n_to_m_rounded_half_up():
    assert [split(c, 3, 1) for c in (1, 2, 4, 6, 8, 100)] == [1, 1, 1, 2, 2, 25]   # C/4: 1.5 -> 2, 0.5 -> 1
    assert [split(c, 1, 1) for c in (1, 3, 10)] == [1, 2, 5]


def test_native_layers_follow_the_variance_schedule():
    """Flat column sums (low variance) in layer 1, one sink taking most attention elsewhere: layer 1
    gets the most entries, and the C++ budgets equal the Python schedule."""
    n, L = 120, 4
    obs = random_obs(5, L, 4, 2, n, kv=True)
    obs.colsum[:] = 1.0
    obs.colsum[[0, 2, 3], :, 0] = 40.0                      # sink-dominated layers: large variance
    obs.colsum[1] += np.linspace(-0.5, 0.5, n, dtype=np.float32)
    plan = both(["merge=none"], 32, obs)
    var = obs.colsum.astype(np.float64).var(axis=2).mean(axis=1)
    want = layer_budgets(layer_weights(list(var), [], "softmax_inv_var"), 32 * L, 2, n)
    assert plan.n_kept[:, 0].tolist() == want
    assert want[1] == max(want) and sum(want) == 32 * L


# ---------------------------------------------------------------------------------------------
# hand-made merge
# ---------------------------------------------------------------------------------------------
def unit(deg, mag=1.0):
    return [mag * math.cos(math.radians(deg)), mag * math.sin(math.radians(deg))]


def handmade_obs():
    """One layer, one head, 8 slots, head_dim 2. Budget 4, N:M = 3:1 -> M = 1 recent (slot 7), N = 3:
    with sinks=1 the sink (slot 0) and the two best column sums among slots 1..6 (slot 3: 3.0, slot 5: 2.5).
    Kept 0, 3, 5, 7 at angles 90, 0, 45, 180 degrees; evicted 1, 2, 4, 6 at 10, 120, 60, 190."""
    angle = {0: 90, 1: 10, 2: 120, 3: 0, 4: 60, 5: 45, 6: 190, 7: 180}
    mag = {0: 1.0, 1: 2.0, 2: 1.0, 3: 1.5, 4: 3.0, 5: 1.0, 6: 0.5, 7: 2.0}
    keys = np.array([unit(angle[j], mag[j]) for j in range(8)], np.float32)[None, None]
    values = np.array([[j, -2.0 * j] for j in range(8)], np.float32)[None, None]
    colsum = np.array([[[5.0, 1.0, 0.5, 3.0, 0.2, 2.5, 0.1, 1.0]]], np.float32)
    return Observation(n_layer=1, n_head=1, n_head_kv=1, head_dim=2, n=8, colsum=colsum, keys=keys,
                       values=values, positions=np.arange(8, dtype=np.int32))


def test_handmade_merge_worked_out():
    obs = handmade_obs()
    plan = both(["sinks=1"], 4, obs)
    assert plan.kept(0, 0).tolist() == [0, 3, 5, 7]
    # best similarities: slot 1 -> slot 3 (cos 10deg), slot 2 -> slot 0 (cos 30deg), slot 4 -> slot 5
    # (cos 15deg), slot 6 -> slot 7 (cos 10deg); tau = their mean = 0.9504: slot 2 (0.866) is dropped
    u = {1: math.cos(math.radians(10)), 2: math.cos(math.radians(30)), 4: math.cos(math.radians(15)),
         6: math.cos(math.radians(10))}
    tau = sum(u.values()) / 4
    assert u[2] < tau <= min(u[1], u[4], u[6])
    assert plan.replace_entry.tolist() == [1, 2, 3]        # entries of slots 3, 5, 7
    K, V = obs.keys[0, 0].astype(np.float64), obs.values[0, 0].astype(np.float64)
    for row, (target, src) in enumerate([(3, 1), (5, 4), (7, 6)]):
        w = math.exp(u[src])
        np.testing.assert_allclose(plan.replace_k[row], (math.e * K[target] + w * K[src]) / (math.e + w), atol=1e-6)
        np.testing.assert_allclose(plan.replace_v[row], (math.e * V[target] + w * V[src]) / (math.e + w), atol=1e-6)

    code = both(["sinks=1", "merge=code"], 4, obs)                      # (x_c + u_i x_i) / 2
    assert code.replace_entry.tolist() == [1, 2, 3]
    np.testing.assert_allclose(code.replace_k[0], (K[3] + u[1] * K[1]) / 2, atol=1e-6)
    np.testing.assert_allclose(code.replace_v[2], (V[7] + u[6] * V[6]) / 2, atol=1e-6)

    none = both(["sinks=1", "merge=none"], 4, obs)
    assert none.kept(0, 0).tolist() == [0, 3, 5, 7] and none.replace_entry.size == 0 and none.log_mult is None


def test_handmade_split_and_sinks():
    obs = handmade_obs()
    plan = both(["heavy=1", "recent=1", "sinks=0", "merge=none"], 4, obs)
    assert plan.kept(0, 0).tolist() == [0, 3, 6, 7]         # M = 2 (slots 6, 7), top-2 colsum in 0..5
    plan = both(["sinks=2", "merge=none"], 4, obs)
    assert plan.kept(0, 0).tolist() == [0, 1, 3, 7]         # slots 0, 1 forced, one heavy hitter
    plan = both(["merge=none"], 4, obs)
    assert plan.kept(0, 0).tolist() == [0, 1, 2, 7]         # default 4 sinks fill all N = 3 heavy places


def test_sinks_skip_the_dead_padding_of_a_reindexed_compaction():
    """Read in chunks, a (layer, head) that keeps fewer entries than the widest starts with dead padding
    (right-aligned re-indexing): it receives no attention, so the sinks are the first slots that do."""
    obs = handmade_obs()
    obs.colsum[0, 0, :2] = 0.0                              # slots 0, 1: dead padding
    plan = both(["sinks=2", "merge=none"], 4, obs)
    assert plan.kept(0, 0).tolist() == [2, 3, 5, 7]         # sinks 2, 3; the best heavy hitter after them: 5
    plan = both(["sinks=1", "merge=none"], 4, obs)
    assert plan.kept(0, 0).tolist() == [2, 3, 5, 7]         # sink 2; heavy hitters 3 (3.0) and 5 (2.5)


# ---------------------------------------------------------------------------------------------
# C++ vs torch on random observations
# ---------------------------------------------------------------------------------------------
SHAPES = [(5, 9, 3, 260), (4, 8, 2, 301), (3, 4, 4, 170), (2, 4, 1, 333)]
VARIANTS = [[], ["allocation=code", "merge=code", "tau=layer", "heavy=1", "recent=1", "full_layers=0,-1"],
            ["allocation=inv_var", "gqa=max", "sinks=0"], ["allocation=exp_decay", "min_frac=0.3"],
            ["allocation=uniform", "gqa=sum", "tau=layer"]]


@pytest.mark.parametrize("vi", range(len(VARIANTS)))
def test_engines_agree_on_random_observations(vi):
    merged = 0
    for si, (n_layer, n_head, n_head_kv, n) in enumerate(SHAPES):
        if VARIANTS[vi] and "full_layers=0,-1" in VARIANTS[vi] and n_layer < 3:
            continue
        obs = random_obs(10 * si + vi, n_layer, n_head, n_head_kv, n, kv=True, ties=si == 3)
        for budget in (40, 97):
            plan = both(VARIANTS[vi], budget, obs)
            merged += plan.replace_entry.size
            assert plan.entries() < n_layer * n_head_kv * n
    assert merged > 0 or "merge=none" in VARIANTS[vi]


def test_short_prompt_is_kept_whole():
    obs = random_obs(2, 3, 6, 2, 50, kv=True)
    plan = both([], 64, obs)
    assert (plan.n_kept == 50).all() and plan.replace_entry.size == 0


def test_errors_are_clear_in_both_engines():
    obs = random_obs(3, 3, 4, 2, 150, kv=True)
    _, params, _ = P.prepare("d2o", [], 64)
    keys = obs.keys
    obs.keys = None
    for run in (lambda: native_plan("d2o", params, 64, obs), lambda: reference_plan("d2o", params, 64, obs)):
        with pytest.raises(KvcliError, match="needs the kv observation"):
            run()
    obs.keys = keys.copy()
    obs.keys[1, 0, 5, 3] = np.nan
    for run in (lambda: native_plan("d2o", params, 64, obs), lambda: reference_plan("d2o", params, 64, obs)):
        with pytest.raises(KvcliError, match="NaN"):
            run()
    obs.keys = keys
    _, params, _ = P.prepare("d2o", ["full_layers=3"], 64)
    for run in (lambda: native_plan("d2o", params, 64, obs), lambda: reference_plan("d2o", params, 64, obs)):
        with pytest.raises(KvcliError, match="full_layers item 3 is outside the model's 3 layers"):
            run()
    with pytest.raises(KvcliError, match="heavy \\+ recent must be >= 1"):
        P.prepare("d2o", ["heavy=0", "recent=0"], 64)


def test_explain_says_prefill_only_and_lists_variants():
    text = P.explain_text("d2o")
    assert "also evicts and merges at every decoding step" in text and "prefill only" in text
    for word in ("softmax_inv_var", "code", "full_layers", "tau", "merge"):
        assert word in text


# ---------------------------------------------------------------------------------------------
# the plan in the real native cache (tiny random model, f32 cache: rows land exactly)
# ---------------------------------------------------------------------------------------------
def compress_in_native_cache(session, policy: str, args: list, budget: int = 48, n: int = 180):
    """Prefill n tokens, compress with the native planner; check the cache holds the plan's rows.

    Returns (plan, stats). Slot j of (l, h) must hold the kept entry's replacement row when the plan
    has one, else the original row of the kept slot."""
    from kvcli.drivers.compress import prefill_and_compress, resolve
    from kvcli.native import cache
    session.clear()
    toks = [int(t) for t in np.random.default_rng(n).integers(300, 5000, size=n)]
    obs = session.prefill(toks, observe=("kv",)).with_kv_arrays()
    session.clear()
    rep = prefill_and_compress(session, toks, resolve(session.model_path, policy, budget, P.get(policy).validate(args)))
    plan = rep.plan
    k, v = cache.read_kv(session.ctx, 0, session.info)
    assert k.shape[2] == plan.max_kept
    row_of = {int(e): r for r, e in enumerate(plan.replace_entry)}
    off = plan.offsets()
    for l in range(plan.n_layer):
        for h in range(plan.n_head_kv):
            f = plan.first_slot(l, h, reindexed=False)   # right-aligned: dead slots first
            for j, slot in enumerate(plan.kept(l, h)):
                r = row_of.get(int(off[l, h]) + j)
                want_k = obs.keys[l, h, slot] if r is None else plan.replace_k[r]
                want_v = obs.values[l, h, slot] if r is None else plan.replace_v[r]
                np.testing.assert_allclose(k[l, h, f + j], want_k, atol=1e-6)
                np.testing.assert_allclose(v[l, h, f + j], want_v, atol=1e-6)
    stats = session.stats()
    assert stats["kv_cells"] == plan.max_kept and stats["per_layer_cells"] == plan.cells_per_layer()
    session.step({0: 1000})                                   # decoding goes on over the merged cells
    assert np.isfinite(session.logits()).all()
    return plan, stats


def test_merged_rows_land_in_the_native_cache(tiny_session):
    plan, _ = compress_in_native_cache(tiny_session, "d2o", [])
    assert plan.replace_entry.size > 0
