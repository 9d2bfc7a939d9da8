"""expected_attention (issue #32): its two planners (numpy for the native engine, torch for the reference) on random
observations give identical plans; both equal an independent computation of kvpress's closed form with explicit
rotation matrices; the registry's checks and refusals. (The query observation and its RoPE pairing:
tests/reference/test_query_observation.py.)"""
from __future__ import annotations

import math

import numpy as np
import pytest
from test_policy_engines_agree import assert_same

import kvcli.policies as P
from kvcli.drivers.chunked import one_prefill_only
from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation
from kvcli.planning.planner import make_plan
from kvcli.planning.rope import Rope

SHAPES = [(3, 4, 2, 16, 200), (2, 6, 3, 8, 150), (2, 4, 4, 16, 120)]   # layers, heads, KV heads, head_dim, n
VARIANTS = [[], ["covariance=off"], ["vnorm=off", "gqa=max"], ["recent=0", "sinks=0", "epsilon=0.01"],
            ["window=40", "n_future=64", "gqa=sum"]]


def both(name, args, budget, obs):
    """The native engine's planner (numpy, kvcli/planning/host_plans.py) and the torch one, through make_plan."""
    spec, params, _ = P.prepare(name, args, budget)
    return make_plan(spec, params, budget, obs, "native"), make_plan(spec, params, budget, obs, "reference")


def rope_for(d: int, neox: bool, theta: float = 10000.0) -> Rope:
    return Rope(freqs=theta ** (-np.arange(0, d, 2, dtype=np.float64) / d), neox=neox)


def query_obs(seed, n_layer, n_head, n_head_kv, d, n, w=64, neox=False, ties=False) -> Observation:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((n_layer, n_head_kv, n, d)).astype(np.float32)
    if ties:   # repeated keys and values: exact ties inside each head
        keys[:, :, 1::3] = keys[:, :, 0:-1:3][:, :, : keys[:, :, 1::3].shape[2]]
    values = rng.standard_normal((n_layer, n_head_kv, n, d)).astype(np.float32)
    if ties:
        values[:, :, 1::3] = values[:, :, 0:-1:3][:, :, : values[:, :, 1::3].shape[2]]
    queries = (0.7 * rng.standard_normal((n_layer, n_head, w, d)) + rng.standard_normal((n_layer, n_head, 1, d)))
    return Observation(n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=d, n=n, keys=keys,
                       values=values, positions=np.arange(n, dtype=np.int32), queries=queries.astype(np.float32),
                       query_positions=np.arange(n - w, n, dtype=np.int32), rope=rope_for(d, neox))


@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("neox", [False, True], ids=["norm", "neox"])
def test_planners_identical(ties, neox):
    for si, shape in enumerate(SHAPES):
        for vi, args in enumerate(VARIANTS):
            obs = query_obs(10 * si + vi, *shape, neox=neox, ties=ties)
            for budget in (40, 97):
                nat, ref = both("expected_attention", args, budget, obs)
                assert_same(nat, ref)
                params = P.get("expected_attention").validate(args)
                assert (nat.n_kept == budget).all()
                s, r = params["sinks"], params["recent"]
                for l in range(obs.n_layer):
                    for h in range(obs.n_head_kv):
                        kept = set(nat.kept(l, h).tolist())
                        assert set(range(s)) <= kept and set(range(obs.n - r, obs.n)) <= kept


def rotation(rope: Rope, angle_per_pair: np.ndarray, d: int) -> np.ndarray:
    """The d x d matrix turning every rotary pair (a, b) by its angle."""
    a, b = rope.pairs()
    R = np.zeros((d, d))
    R[a, a], R[a, b] = np.cos(angle_per_pair), -np.sin(angle_per_pair)
    R[b, a], R[b, b] = np.sin(angle_per_pair), np.cos(angle_per_pair)
    return R


def closed_form_kept(obs: Observation, params: dict, budget: int) -> list[list[np.ndarray]]:
    """kvpress's ExpectedAttentionPress, written with explicit matrices: queries un-rotated (R(p)^T q), mean and
    biased covariance, the mean rotation matrix of the next n_future positions applied (R mu, R Sigma R^T),
    softmax over the keys after the sinks of mu.k/sqrt(d) + k'Sigma k/(2d), mean over the group, x ||v||."""
    d, n, G, s, rec = obs.head_dim, obs.n, obs.n_head // obs.n_head_kv, params["sinks"], params["recent"]
    rope = obs.rope
    Rbar = np.mean([rotation(rope, t * rope.freqs, d) for t in range(n, n + params["n_future"])], axis=0)
    rows = obs.query_positions >= s
    out = []
    for l in range(obs.n_layer):
        layer = []
        for h in range(obs.n_head_kv):
            probs = []
            for q in range(h * G, (h + 1) * G):
                pre = np.stack([rotation(rope, p * rope.freqs, d).T @ x.astype(np.float64)
                                for p, x in zip(obs.query_positions[rows], obs.queries[l, q][rows])])
                mu = pre.mean(axis=0)
                cov = (pre - mu).T @ (pre - mu) / len(pre)
                mu, cov = Rbar @ mu, Rbar @ cov @ Rbar.T
                K = obs.keys[l, h, s:].astype(np.float64)
                logit = K @ mu / math.sqrt(d) + np.einsum("ni,ij,nj->n", K, cov, K) / (2 * d)
                e = np.exp(logit - logit.max())
                probs.append(e / e.sum())
            score = np.mean(probs, axis=0) * np.linalg.norm(obs.values[l, h, s:].astype(np.float64), axis=1)
            best = np.sort(np.argsort(-score[: n - rec - s], kind="stable")[: budget - s - rec])
            layer.append(np.concatenate([np.arange(s), s + best, np.arange(n - rec, n)]))
        out.append(layer)
    return out


@pytest.mark.parametrize("neox", [False, True], ids=["norm", "neox"])
def test_planners_compute_kvpress_closed_form(neox):
    obs = query_obs(5, 2, 4, 2, 16, 160, w=48, neox=neox)
    for args in ([], ["recent=0"]):
        params = P.get("expected_attention").validate(args)
        nat, ref = both("expected_attention", args, 50, obs)
        want = closed_form_kept(obs, params, 50)
        for l in range(obs.n_layer):
            for h in range(obs.n_head_kv):
                assert np.array_equal(nat.kept(l, h), want[l][h]), (args, l, h)


def test_registry_checks_and_refusals():
    spec = P.get("expected_attention")
    assert spec.agnostic and spec.host_planned and spec.native and spec.reference
    assert spec.observe(spec.defaults()) == (("query", "kv"), 512)
    with pytest.raises(KvcliError, match="sinks \\+ recent"):
        P.prepare("expected_attention", [], 12)
    with pytest.raises(KvcliError, match="must be one of"):
        P.prepare("expected_attention", ["covariance=maybe"], 64)
    assert one_prefill_only("expected_attention")
    text = P.explain_text("expected_attention")
    assert "Expected Attention" in text and "n_future = 512" in text and "kvpress" in text


def test_needs_the_query_observation():
    obs = query_obs(1, *SHAPES[0])
    obs.queries = obs.query_positions = None
    spec, params, _ = P.prepare("expected_attention", [], 40)
    for planner in ("native", "reference"):
        with pytest.raises(KvcliError, match="query observation"):
            make_plan(spec, params, 40, obs, planner)


def test_sliding_window_models_are_refused(tmp_path):
    from kvcli.planning.planner import model_refusal
    from kvcli.testing.tiny_gguf import write_tiny
    path = write_tiny(tmp_path / "g.gguf", "gemma3", n_layer=2, n_head=4, n_head_kv=2, head_dim=16)
    why = model_refusal(P.get("expected_attention"), path)
    assert why and "sliding-window" in why
    assert model_refusal(P.get("expected_attention"), write_tiny(tmp_path / "q.gguf", "qwen2", n_layer=2)) is None
