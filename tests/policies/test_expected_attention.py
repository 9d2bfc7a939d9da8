"""expected_attention (issue #32): its two planners (C++ for the native engine, torch for the reference) give identical
plans on random observations (L1: norm and NEOX pairing, linear scaling and Llama 3 frequency factors, exact ties) and
on the native observation of tiny random llama and qwen2 GGUFs; both equal an independent computation of kvpress's
closed form with explicit rotation matrices; the C++ planner refuses what it cannot undo; the registry's checks and
refusals. (The query observation and its RoPE pairing: tests/reference/test_query_observation.py.)"""
from __future__ import annotations

import math

import numpy as np
import pytest
from policy_obs import assert_same

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.planning.formats import Observation
from kvcli.native.lib import native_plan
from kvcli.planning.planner import make_plan
from kvcli.planning.rope import Rope

SHAPES = [(3, 4, 2, 16, 200), (2, 6, 3, 8, 150), (2, 4, 4, 16, 120)]   # layers, heads, KV heads, head_dim, n
VARIANTS = [[], ["covariance=off"], ["vnorm=off", "gqa=max"], ["recent=0", "sinks=0", "epsilon=0.01"],
            ["window=40", "n_future=64", "gqa=sum"]]


def both(name, args, budget, obs):
    """The native engine's planner (C++, native/src/policies/expected_attention.cpp) and the torch one, through
    make_plan."""
    spec, params, _ = P.prepare(name, args, budget)
    return make_plan(spec, params, budget, obs, "native"), make_plan(spec, params, budget, obs, "reference")


def rope_for(d: int, neox: bool, theta: float = 10000.0, scaled: bool = False) -> Rope:
    """Plain RoPE, or (scaled) a linear factor 4 and Llama 3 style per-pair frequency factors."""
    if not scaled:
        return Rope(neox=neox, n_rot=d, freq_base=theta)
    factors = np.linspace(1.0, 8.0, d // 2).astype(np.float32)
    return Rope(neox=neox, n_rot=d, freq_base=theta, freq_scale=0.25, factors=factors)


def query_obs(seed, n_layer, n_head, n_head_kv, d, n, w=64, neox=False, ties=False, scaled=False) -> Observation:
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
                       query_positions=np.arange(n - w, n, dtype=np.int32), rope=rope_for(d, neox, scaled=scaled))


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
@pytest.mark.parametrize("ties", [False, True], ids=["random", "ties"])
@pytest.mark.parametrize("neox", [False, True], ids=["norm", "neox"])
def test_planners_identical(ties, neox, scaled):
    for si, shape in enumerate(SHAPES):
        for vi, args in enumerate(VARIANTS):
            obs = query_obs(10 * si + vi, *shape, neox=neox, ties=ties, scaled=scaled)
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


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
@pytest.mark.parametrize("neox", [False, True], ids=["norm", "neox"])
def test_planners_compute_kvpress_closed_form(neox, scaled):
    obs = query_obs(5, 2, 4, 2, 16, 160, w=48, neox=neox, scaled=scaled)
    for args in ([], ["recent=0"]):
        params = P.get("expected_attention").validate(args)
        nat, ref = both("expected_attention", args, 50, obs)
        want = closed_form_kept(obs, params, 50)
        for l in range(obs.n_layer):
            for h in range(obs.n_head_kv):
                assert np.array_equal(nat.kept(l, h), want[l][h]), (args, l, h)


def test_registry_checks_and_refusals():
    spec = P.get("expected_attention")
    assert spec.agnostic and spec.native and spec.reference
    assert spec.observe(spec.defaults()) == (("query", "kv"), 512)
    with pytest.raises(KvcliError, match="sinks \\+ recent"):
        P.prepare("expected_attention", [], 12)
    with pytest.raises(KvcliError, match="must be one of"):
        P.prepare("expected_attention", ["covariance=maybe"], 64)
    text = P.explain_text("expected_attention")
    assert "Expected Attention" in text and "n_future = 512" in text and "kvpress" in text


def test_needs_the_query_observation():
    obs = query_obs(1, *SHAPES[0])
    obs.queries = obs.query_positions = None
    spec, params, _ = P.prepare("expected_attention", [], 40)
    for planner in ("native", "reference"):
        with pytest.raises(KvcliError, match="query observation"):
            make_plan(spec, params, 40, obs, planner)


def test_window_takes_the_last_rows():
    """An observation holding more rows than `window`: both planners use the last `window` (what
    Observation.restrict would cut), and differ from a plan over every row."""
    obs = query_obs(3, 2, 4, 2, 16, 150, w=100)
    cut = query_obs(3, 2, 4, 2, 16, 150, w=100)
    cut.queries, cut.query_positions = obs.queries[:, :, -30:], obs.query_positions[-30:]
    nat, ref = both("expected_attention", ["window=30"], 40, obs)
    assert_same(nat, ref)
    assert_same(nat, both("expected_attention", ["window=4096"], 40, cut)[0])
    assert not np.array_equal(nat.slots, both("expected_attention", ["window=4096"], 40, obs)[0].slots)


def test_native_planner_refusals():
    """What the C++ planner cannot undo, or an observation it cannot use, is one clear error."""
    spec, params, _ = P.prepare("expected_attention", [], 40)
    obs = query_obs(2, 2, 4, 2, 16, 120)
    obs.rope = Rope(neox=True, n_rot=12, freq_base=10000.0)
    with pytest.raises(KvcliError, match="partial rotary dimensions \\(12 of 16\\)"):
        native_plan("expected_attention", params, 40, obs)
    obs.rope = Rope(neox=False, n_rot=16, freq_base=10000.0, factors=np.full(8, -1.0, np.float32))
    with pytest.raises(KvcliError, match="frequency factors must be finite and positive"):
        native_plan("expected_attention", params, 40, obs)
    obs = query_obs(2, 2, 4, 2, 16, 120)
    obs.queries[1, 2, 5, 3] = np.nan
    with pytest.raises(KvcliError, match="contains NaN \\(queries\\)"):
        native_plan("expected_attention", params, 40, obs)
    obs.query_positions = np.arange(4, dtype=np.int32)   # every row inside the 4 sinks
    obs.queries = obs.queries[:, :, :4]
    with pytest.raises(KvcliError, match="no observed query lies after the sinks"):
        native_plan("expected_attention", params, 40, obs)


def test_native_planner_refuses_other_rope_types():
    """llama.cpp's other rope types (M-RoPE: several positions per row) reach the C API only from another caller."""
    import ctypes  # noqa: PLC0415

    from kvcli.native.lib import lib, obs_view  # noqa: PLC0415
    spec, params, _ = P.prepare("expected_attention", [], 40)
    obs = query_obs(2, 2, 4, 2, 16, 120)
    view, keep = obs_view(obs)
    view.rope.type = 8
    L = lib()
    text = spec.native_params(params, 40, obs.n_layer, obs.n).encode()
    assert not L.kvcli_plan_make(b"expected_attention", text, 40, ctypes.byref(view))
    assert "rope type 8 (M-RoPE); only norm (0) and neox (2) are supported" in L.last_error()
    del keep


TINY = [("llama", {}, 4, 2), ("llama", {"rope_scaling": {"type": "linear", "factor": 2.0}}, 6, 2),
        ("llama", "llama3", 4, 1), ("qwen2", {}, 6, 2), ("qwen2", {}, 4, 4), ("phi3", {}, 4, 2)]


@pytest.mark.parametrize("arch,extra,n_head,n_head_kv", TINY,
                         ids=["llama", "llama-linear", "llama-rope_freqs", "qwen2", "qwen2-mha", "phi3"])
def test_l1_on_tiny_gguf_observation(tmp_path, arch, extra, n_head, n_head_kv):
    """L1 on a real native observation (f16 cache, flash attention: the product's path): the C++ plan equals the torch
    plan; for llama, qwen2 and phi3 shapes, linear scaling and Llama 3 rope_freqs factors, GQA and MHA."""
    from kvcli.native.session import NativeSession  # noqa: PLC0415
    from kvcli.testing.tiny_gguf import llama3_rope_freqs, write_tiny  # noqa: PLC0415
    kw = {"rope_tensors": {"rope_freqs": llama3_rope_freqs(16)}} if extra == "llama3" else extra
    path = write_tiny(tmp_path / f"{arch}.gguf", arch, n_layer=2, n_head=n_head, n_head_kv=n_head_kv, head_dim=16,
                      seed=7, **kw)
    tokens = [int(t) for t in np.random.default_rng(4).integers(5, 200, size=300)]
    s = NativeSession(path, n_ctx=512)
    try:
        obs = s.prefill(tokens, observe=("query", "kv"), window=128)
        assert obs.rope.neox == (arch != "llama") and (obs.rope.factors is not None) == (extra == "llama3")
        if extra and extra != "llama3":
            assert obs.rope.freq_scale == 0.5
        for args, budget in (([], 64), (["covariance=off", "gqa=max"], 100), (["window=64", "recent=0"], 32)):
            nat, ref = both("expected_attention", args, budget, obs)
            assert_same(nat, ref)
            assert (nat.n_kept == budget).all()
    finally:
        s.close()


def test_sliding_window_models_are_refused(tmp_path):
    from kvcli.planning.planner import model_refusal
    from kvcli.testing.tiny_gguf import write_tiny
    path = write_tiny(tmp_path / "g.gguf", "gemma3", n_layer=2, n_head=4, n_head_kv=2, head_dim=16)
    why = model_refusal(P.get("expected_attention"), path)
    assert why and "sliding-window" in why
    assert model_refusal(P.get("expected_attention"), write_tiny(tmp_path / "q.gguf", "qwen2", n_layer=2)) is None
