"""kvcli.drivers.compress, the one compression driver: `Shared` (one prefill, many configurations) leaves each
configuration the very cache its own prefill + compression leaves, in both engines; a failing observation
still serves the configurations that need none. On the real native library / torch engine and a tiny model."""
from __future__ import annotations

import numpy as np
import pytest

from kvcli.drivers.compress import Shared, compress_as, resolve
from kvcli.errors import KvcliError
from kvcli.native.session import NativeSession
from kvcli.testing.tiny_gguf import write_tiny_llama

N = 160
CONFIGS = [("full", None, {}), ("snapkv", 48, {"window": 16}), ("h2o", 40, {}), ("streamingllm", 32, {}),
           ("snapkv", 400, {"window": 16})]   # the last one: the prompt fits its budget


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("driver") / "tiny.gguf", n_layer=2, n_head=4, n_head_kv=2,
                            head_dim=32, n_ctx_train=1024)


def prompt(n: int = N) -> list[int]:
    return [int(t) for t in np.random.default_rng(7).integers(3, 200, n)]


def _session(engine, model):
    if engine == "native":
        return NativeSession(model, n_ctx=256, cache_type="f32", flash_attn=False, n_threads=2)
    from kvcli.reference.session import ReferenceSession
    return ReferenceSession(model, n_ctx=256)


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_one_prefill_serves_each_configuration_as_its_own_prefill_would(tiny, engine):
    s, alone = _session(engine, tiny), _session(engine, tiny)
    cfgs = [resolve(tiny, p, b, args) for p, b, args in CONFIGS]
    shared = Shared(s, prompt(), cfgs)
    assert shared.error is None and shared.obs.windows == (16,) and shared.obs.colsum is not None
    for cfg in cfgs:
        applied = shared.apply(cfg)
        assert applied.error is None
        alone.clear(0)
        rep = compress_as(alone, prompt(), cfg)
        assert applied.note == rep.note
        assert (applied.plan is None) == (rep.plan is None) == (not cfg.compresses(N))
        assert s.stats(0)["kv_cells"] == alone.stats(0)["kv_cells"]
        for a, b in zip(s.kept_positions(0), alone.kept_positions(0)):
            for ha, hb in zip(a, b):
                assert np.array_equal(ha, hb), cfg.policy
        s.step({0: 5})      # the caller decodes before the next configuration: it is put back all the same
        alone.step({0: 5})
        np.testing.assert_allclose(s.logits(0), alone.logits(0), atol=1e-5, rtol=0)
    assert shared.apply(cfgs[-1]).note == f"no compression: the prompt ({N} tokens) fits the budget (400)"


def test_a_failed_observation_still_serves_the_configurations_that_need_none(tiny):
    s = _session("native", tiny)
    cfgs = [resolve(tiny, p, b, args) for p, b, args in CONFIGS[:2]]
    shared = Shared(s, prompt(), cfgs, window=(N + 1,))    # a window longer than the prompt: refused
    assert shared.error is None and isinstance(shared.obs_error, KvcliError)
    full, snapkv = (shared.apply(c) for c in cfgs)
    assert full.error is None and s.stats(0)["kv_cells"] == N
    assert isinstance(snapkv.error, KvcliError) and "window" in str(snapkv.error)


def test_plan_always_plans_a_prompt_within_the_budget_and_applies_nothing(tiny):
    s = _session("native", tiny)
    seen = []
    rep = compress_as(s, prompt(), resolve(tiny, "snapkv", 400, {"window": 16}), plan_always=True,
                      on_step=lambda step, obs, plan: seen.append((step, obs.n, plan.entries())))
    assert seen == [(0, N, 2 * 2 * N)] and rep.plan is not None and s.stats(0)["kv_cells"] == N


def test_full_takes_no_policy_argument(tiny):
    with pytest.raises(KvcliError, match="policy 'full' takes no --policy-arg"):
        resolve(tiny, "full", None, {"window": 8})
