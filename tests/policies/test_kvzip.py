"""kvzip's two planners (C++ and torch) on random column maxima: identical plans for every allocation, the
budget kept as documented, the sinks and recent slots always kept; its registry checks."""
from __future__ import annotations

import numpy as np
import pytest
from policy_obs import assert_same, engine_plans

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation

SHAPES = [(5, 9, 3, 260), (4, 8, 2, 301), (3, 4, 4, 170), (1, 6, 2, 150)]
VARIANTS = [[], ["alloc=layer"], ["alloc=global"], ["gqa=mean", "sinks=0", "recent=0"], ["gqa=sum", "alloc=global",
            "recent=3"]]


def colmax_obs(seed, n_layer, n_head, n_head_kv, n, ties=False) -> Observation:
    rng = np.random.default_rng(seed)
    if ties:   # few distinct values: many exact ties across heads, layers and slots
        m = rng.integers(0, 4, size=(n_layer, n_head, n)).astype(np.float32) / 4
    else:
        m = rng.beta(0.3, 3.0, size=(n_layer, n_head, n)).astype(np.float32)
    return Observation(n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=8, n=n, colmax=m,
                       positions=np.arange(n, dtype=np.int32))


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
def test_kvzip_planners_identical(ties):
    for si, shape in enumerate(SHAPES):
        for vi, args in enumerate(VARIANTS):
            obs = colmax_obs(10 * si + vi, *shape, ties=ties)
            for budget in (40, 97):
                nat, ref = engine_plans("kvzip", args, budget, obs)
                assert_same(nat, ref)
                params = P.get("kvzip").validate(args)
                L, H = obs.n_layer, obs.n_head_kv
                if params["alloc"] == "head":
                    assert (nat.n_kept == budget).all()
                elif params["alloc"] == "layer":
                    assert (nat.n_kept.sum(axis=1) == budget * H).all()
                else:
                    assert nat.n_kept.sum() == budget * H * L
                s, r = params["sinks"], params["recent"]
                for lst in nat.kept_lists():
                    for k in lst:
                        assert set(range(s)) | set(range(obs.n - r, obs.n)) <= set(k.tolist())


def test_kvzip_keeps_the_highest_maxima():
    """alloc=head keeps, per KV head, the slots whose largest group maximum is highest (gqa=max)."""
    obs = colmax_obs(3, 2, 4, 2, 120)
    nat, _ = engine_plans("kvzip", ["sinks=0", "recent=0"], 30, obs)
    for l in range(2):
        for h in range(2):
            score = obs.colmax[l, 2 * h:2 * h + 2].max(axis=0)
            assert set(nat.kept(l, h).tolist()) == set(np.argsort(-score, kind="stable")[:30].tolist())


def test_kvzip_without_colmax_and_small_budget_refused():
    obs = colmax_obs(0, 2, 4, 2, 100)
    obs.colmax = None
    with pytest.raises(KvcliError, match="colmax"):
        engine_plans("kvzip", [], 50, obs)
    with pytest.raises(KvcliError, match="sinks \\+ recent"):
        P.prepare("kvzip", ["sinks=10", "recent=6"], 16)


def test_kvzip_is_read_in_chunks_when_it_must_be():
    """Bounded reading does not turn on by itself for kvzip; a prompt that must be read in chunks (longer than the
    context, or --chunk N) is read in chunks, its reconstruction pass run chunk by chunk
    (tests/test_kvzip_chunked.py)."""
    from kvcli.drivers.chunked import plan_chunking
    from helpers import compression
    c = plan_chunking(20_000, 256, 32_768, compression("kvzip", 1024), cell_bytes=1 << 20)
    assert c.chunk is None and c.n_ctx >= 20_000 + 2048
    assert plan_chunking(40_000, 256, 32_768, compression("kvzip", 1024), cell_bytes=1 << 20).chunk == 1024
    assert plan_chunking(5_000, 256, 32_768, compression("kvzip", 1024), chunk=1024, cell_bytes=1 << 20).chunk == 1024
    assert "reconstruction pass runs over that chunk only" in P.explain_text("kvzip")
