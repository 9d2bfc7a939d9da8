"""Issue #19: the K/V rows of merging policies (d2o, spindlekv) are observed one layer at a time.

A native observation holds no all-layer K/V array: it carries a reader (Observation.kv_reader) that both
planners call for one layer's rows when they merge in that layer. These tests pin that both planners read
each layer at most once, in order, the same layers, and give the same plans as from whole arrays (L1).
"""
from __future__ import annotations

import signal

import numpy as np
import pytest
from policy_obs import random_obs
from test_d2o import assert_same

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.native.lib import native_plan
from kvcli.planning.formats import Observation
from kvcli.reference.policies import reference_plan


class Recorder:
    """A kv_reader over whole arrays that records the layers asked for and the shapes it filled."""

    def __init__(self, keys: np.ndarray, values: np.ndarray, fail_at: int | None = None):
        self.keys, self.values, self.fail_at, self.layers = keys, values, fail_at, []

    def __call__(self, il: int, k: np.ndarray, v: np.ndarray) -> None:
        assert k.shape == v.shape == self.keys.shape[1:] and k.dtype == v.dtype == np.float32
        self.layers.append(il)
        if il == self.fail_at:
            raise KvcliError(f"layer {il} cannot be read")
        k[...] = self.keys[il]
        v[...] = self.values[il]


def by_reader(obs: Observation, fail_at: int | None = None) -> tuple[Observation, Recorder]:
    rec = Recorder(obs.keys, obs.values, fail_at)
    return Observation(obs.n_layer, obs.n_head, obs.n_head_kv, obs.head_dim, obs.n, window_sums=obs.window_sums,
                       windows=obs.windows, colsum=obs.colsum, positions=obs.positions, kv_reader=rec), rec


@pytest.mark.parametrize("policy,args,layers", [
    ("d2o", [], [0, 1, 2, 3]),
    ("d2o", ["merge=code", "tau=layer", "full_layers=1"], [0, 2, 3]),   # a full layer evicts nothing: not read
    ("d2o", ["merge=none"], []),
    ("spindlekv", [], [0, 1, 2, 3]),
    ("spindlekv", ["codebook_layers=2", "theta_k=0.3"], [0, 1]),
])
def test_both_planners_read_one_layer_at_a_time_and_plan_as_from_whole_arrays(policy, args, layers):
    obs = random_obs(7, n_layer=4, n_head=6, n_head_kv=2, n=200, w=8, kv=True)
    _, params, _ = P.prepare(policy, args, 64)
    want = native_plan(policy, params, 64, obs)
    assert_same(want, reference_plan(policy, params, 64, obs))
    for planner in (native_plan, reference_plan):
        lazy, rec = by_reader(obs)
        got = planner(policy, params, 64, lazy)
        assert rec.layers == layers, planner.__name__        # each merged layer once, in order, none other
        assert_same(got, want)
        if planner is native_plan:   # the same float inputs: the same rows, bit for bit
            for x, y in ((got.replace_k, want.replace_k), (got.replace_v, want.replace_v)):
                assert (x is None and y is None) or np.array_equal(x, y)


@pytest.mark.parametrize("policy", ["d2o", "spindlekv"])
def test_a_failing_reader_is_the_planners_error(policy):
    obs = random_obs(3, n_layer=3, n_head=4, n_head_kv=2, n=150, w=8, kv=True)
    _, params, _ = P.prepare(policy, [], 64)
    for planner in (native_plan, reference_plan):
        lazy, rec = by_reader(obs, fail_at=1)
        with pytest.raises(KvcliError, match="layer 1 cannot be read"):
            planner(policy, params, 64, lazy)
        assert rec.layers == [0, 1]                            # stopped at the failing layer


@pytest.mark.parametrize("policy", ["d2o", "spindlekv"])
def test_ctrl_c_while_the_native_planner_reads_is_a_keyboard_interrupt_after_it(policy, sigint_raises):
    """Ctrl-C that arrives while the C planner runs is a KeyboardInterrupt once it has returned, not the planner's
    error (it reached the reader callback's entry, where it cannot cross the C frames and was lost): the planner
    reads every layer, then the interrupt comes."""
    obs = random_obs(3, n_layer=3, n_head=4, n_head_kv=2, n=150, w=8, kv=True)
    _, params, _ = P.prepare(policy, [], 64)
    lazy, rec = by_reader(obs)
    reader = lazy.kv_reader

    def interrupted(il, k, v):
        if il == 0:
            signal.raise_signal(signal.SIGINT)
        reader(il, k, v)
    lazy.kv_reader = interrupted
    with pytest.raises(KeyboardInterrupt):
        native_plan(policy, params, 64, lazy)
    assert rec.layers == [0, 1, 2]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler   # the handler is back


def test_nan_in_a_read_layer_is_refused_by_both_planners():
    obs = random_obs(4, n_layer=3, n_head=4, n_head_kv=2, n=150, w=8, kv=True)
    obs.values = obs.values.copy()
    obs.values[2, 1, 7, 0] = np.nan
    _, params, _ = P.prepare("d2o", [], 64)
    for planner in (native_plan, reference_plan):
        lazy, rec = by_reader(obs)
        with pytest.raises(KvcliError, match="NaN"):
            planner("d2o", params, 64, lazy)
        assert rec.layers == [0, 1, 2]


@pytest.mark.parametrize("policy", ["d2o", "spindlekv"])
def test_the_native_observation_holds_no_all_layer_kv(tiny_session, policy):
    """The engine's observation reads K/V from the live cache when a planner asks, one layer at a time; the
    plans match those from the whole arrays in both planners; once the sequence changes the reader refuses."""
    from kvcli.native import cache
    s = tiny_session
    s.clear()
    toks = [int(t) for t in np.random.default_rng(5).integers(300, 5000, size=160)]
    spec, params, _ = P.prepare(policy, [], 48)
    kinds, w = spec.observe(params)
    obs = s.prefill(toks, observe=kinds, window=w)
    assert obs.keys is None and obs.values is None and isinstance(obs.kv_reader, cache.KvReader)
    whole = obs.with_kv_arrays()
    assert whole.keys.shape == (3, 2, 160, 16) and whole.kv_reader is None
    k1, v1 = obs.layer_kv(1)
    assert np.array_equal(k1, whole.keys[1]) and np.array_equal(v1, whole.values[1])
    plan = native_plan(policy, params, 48, obs)
    assert_same(plan, native_plan(policy, params, 48, whole))
    assert_same(plan, reference_plan(policy, params, 48, obs))
    s.apply_plan(plan)
    with pytest.raises(KvcliError, match="changed since it was observed"):
        obs.layer_kv(0)
    with pytest.raises(KvcliError, match="changed since it was observed"):
        native_plan(policy, params, 48, obs)


def test_the_native_plans_rows_are_not_copied_and_outlive_the_plan():
    """Merged rows (up to 2 x entries x head_dim floats) are views of the native plan's memory, which they keep
    alive: no second copy while the plan is made, and still valid once the Plan object is gone."""
    import gc
    obs = random_obs(9, n_layer=3, n_head=4, n_head_kv=2, n=150, w=8, kv=True)
    _, params, _ = P.prepare("d2o", [], 64)
    plan = native_plan("d2o", params, 64, obs)
    assert plan.replace_entry.size and not plan.replace_k.flags.owndata and not plan.replace_v.flags.owndata
    want_k, want_v = reference_plan("d2o", params, 64, obs).replace_k, plan.replace_v.copy()
    rk, rv = plan.replace_k, plan.replace_v
    del plan
    for _ in range(3):   # other plans reuse the freed memory if the rows did not keep theirs
        native_plan("d2o", params, 64, random_obs(10, n_layer=3, n_head=4, n_head_kv=2, n=150, w=8, kv=True))
        gc.collect()
    np.testing.assert_allclose(rk, want_k, atol=1e-5, rtol=0)
    assert np.array_equal(rv, want_v)


def test_one_shared_prefill_serves_merging_policies_from_the_restored_sequence(tiny_session):
    """kvcli.drivers.compress.Shared plans each configuration after putting the prefilled sequence back: the K/V reader
    reads the restored rows, and each plan equals that of the configuration's own prefill."""
    from kvcli.drivers.compress import Shared, compress_as, resolve
    from kvcli.native.session import NativeSession
    s = tiny_session
    s.clear()
    toks = [int(t) for t in np.random.default_rng(8).integers(300, 5000, size=160)]
    cfgs = [resolve(s.model_path, p, 48, args) for p, args in (("d2o", {}), ("spindlekv", {"theta_k": 0.3}),
                                                              ("d2o", {"merge": "code"}))]
    shared = Shared(s, toks, cfgs)
    assert shared.error is None and shared.obs.keys is None and shared.obs.kv_reader is not None
    alone = NativeSession(s.model_path, n_ctx=512, cache_type="f32", flash_attn=False)
    try:
        for cfg in cfgs:
            applied = shared.apply(cfg)
            assert applied.error is None, applied.error
            alone.clear()
            assert_same(applied.plan, compress_as(alone, toks, cfg).plan)
            assert applied.plan.replace_entry.size
    finally:
        alone.close()
