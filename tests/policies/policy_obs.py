"""Random observations for the planner cross-checks (no model needed), and the two engines' plans of one
observation compared (`engine_plans`, `assert_same`)."""
from __future__ import annotations

import numpy as np

import kvcli.policies as P
from kvcli.native.lib import native_plan
from kvcli.planning.formats import Observation, sum_window_rows
from kvcli.reference.policies import reference_plan


# the window lengths the policy tests plan with (besides w itself)
TEST_WINDOWS = (1, 2, 3, 4, 5, 7, 8, 16, 24, 32)


def random_obs(seed: int, n_layer: int = 4, n_head: int = 6, n_head_kv: int = 2, n: int = 200, w: int = 32,
               ties: bool = False, head_dim: int = 8, kv: bool = False) -> Observation:
    """Causal window attention of the last w queries, reduced as the engines reduce it (window sums of
    every length of TEST_WINDOWS up to w, and of w: the last rows added in float64, then rounded to
    float32), and column sums of every query, per query head.

    ties=True draws small integer weights (many exact ties and zeros) instead of softmaxed logits.
    """
    rng = np.random.default_rng(seed)
    w = min(w, n)

    def rows(q_slots: np.ndarray) -> np.ndarray:
        m = len(q_slots)
        if ties:
            x = rng.integers(0, 4, size=(n_layer, n_head, m, n)).astype(np.float32)
        else:
            x = np.exp(rng.normal(0, 2.0, size=(n_layer, n_head, m, n))).astype(np.float32)
        causal = np.arange(n)[None, :] <= q_slots[:, None]
        x = np.where(causal[None, None], x, 0).astype(np.float32)
        x[..., np.arange(m), q_slots] += np.float32(1.0)   # every query sees itself: rows never sum to 0
        return (x / x.sum(-1, keepdims=True)).astype(np.float32)

    window = rows(np.arange(n - w, n))
    # column sums of a causal attention: slot j is seen by n - j queries; a random share of that mass
    seen = (n - np.arange(n)).astype(np.float32)
    colsum = (rng.exponential(1.0, size=(n_layer, n_head, n)) * seen / n * 4).astype(np.float32)
    if ties:
        colsum = np.round(colsum * 2) / 2
    windows = tuple(sorted({x for x in TEST_WINDOWS if x <= w} | {w}))
    sums = sum_window_rows(window, windows)
    obs = Observation(n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv, head_dim=head_dim, n=n,
                      window_sums=sums, windows=windows, colsum=np.ascontiguousarray(colsum, np.float32),
                      positions=np.arange(n, dtype=np.int32))
    if kv:
        obs.keys = rng.normal(size=(n_layer, n_head_kv, n, head_dim)).astype(np.float32)
        obs.values = rng.normal(size=(n_layer, n_head_kv, n, head_dim)).astype(np.float32)
    return obs


def engine_plans(name, args, budget, obs):
    """The C++ planner's and the torch planner's plans of `obs` (each validated)."""
    _, params, _ = P.prepare(name, args, budget)
    nat = native_plan(name, params, budget, obs)
    ref = reference_plan(name, params, budget, obs)
    nat.validate(obs.n, obs.head_dim)
    ref.validate(obs.n, obs.head_dim)
    return nat, ref


def assert_same(a, b):
    """Two plans alike: kept slots identical, log-multiplicities and merged rows within 1e-5."""
    assert np.array_equal(a.n_kept, b.n_kept), f"n_kept differ:\n{a.n_kept}\n{b.n_kept}"
    assert np.array_equal(a.slots, b.slots), "kept slots differ"
    assert (a.log_mult is None) == (b.log_mult is None)
    if a.log_mult is not None:
        np.testing.assert_allclose(a.log_mult, b.log_mult, atol=1e-5)
    assert np.array_equal(a.replace_entry, b.replace_entry), "merged entries differ"
    for x, y in ((a.replace_k, b.replace_k), (a.replace_v, b.replace_v)):
        assert (x is None) == (y is None)
        if x is not None:
            np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)


def np_pool(s: np.ndarray, kernel: int, pool: str) -> np.ndarray:
    """Centred 1-D pooling along the last axis, stride 1, padding kernel // 2 (max pads with -inf, avg counts the
    zero pads), as F.max_pool1d / F.avg_pool1d: the policy tests' own numpy version of the engines' pooling."""
    if kernel <= 1:
        return s
    h, n = kernel // 2, s.shape[-1]
    padded = np.pad(s, [(0, 0)] * (s.ndim - 1) + [(h, h)], constant_values=-np.inf if pool == "max" else 0.0)
    shifted = [padded[..., i:i + n] for i in range(kernel)]
    if pool == "max":
        return np.maximum.reduce(shifted)
    acc = np.zeros_like(s)
    for x in shifted:
        acc = acc + x
    return acc / kernel


def np_group(per_q: np.ndarray, n_head_kv: int, gqa: str) -> np.ndarray:
    """[n_head, ...] -> [n_head_kv, ...]: the query heads of each KV head's group added in order (mean: then / G)
    or their maximum."""
    G = per_q.shape[0] // n_head_kv
    grouped = per_q.reshape((n_head_kv, G) + per_q.shape[1:])
    out = grouped[:, 0].copy()
    for g in range(1, G):
        out = np.maximum(out, grouped[:, g]) if gqa == "max" else out + grouped[:, g]
    return out / G if gqa == "mean" and G > 1 else out


def np_snap_scores(obs, layer: int, window: int, kernel: int, pool: str, gqa: str) -> np.ndarray:
    """SnapKV's score of the prefix slots of one layer ([n_head_kv, n - window] float64): the window queries'
    attention summed (the observation's window sums), pooled per query head, combined per KV head."""
    sums = obs.window_sum(window)[layer, :, : obs.n - window].astype(np.float64)
    return np_group(np_pool(sums, kernel, pool), obs.n_head_kv, gqa)


def np_top(scores: np.ndarray, k: int) -> list[int]:
    """The k best indices of a 1-D score (ties to the lower index), ascending."""
    return sorted(np.argsort(-scores, kind="stable")[:k].tolist())
