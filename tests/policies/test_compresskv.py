"""compresskv: per layer, the window plus the B_l - window prefix slots with the highest pooled window attention of
the layer's semantic retrieval heads (SRH; their mean, in calibration order), one set shared by every KV head; layer
budgets B_l from the calibrated error profile by Algorithm 1 (design/methods/compresskv.md §2.3: B_l = clip(m +
round(e_l x (B x L - m x L)), m, 3B), the difference to B x L handed to the argmax / taken from the argmin of e).
Both written here in numpy and checked against both planners on random observations."""
from __future__ import annotations

import numpy as np
import pytest
from policy_obs import engine_plans, np_pool, np_top, random_obs


def algorithm_1(e: list[float], B: int, m: int = 32, max_factor: int = 3) -> list[int]:
    """The paper's allocator as the digest writes it (m capped at B, as kvcli documents)."""
    n, m = len(e), min(m, B)
    M, total = max_factor * B, B * len(e)
    b = [int(np.clip(m + np.round(x * (total - m * n)), m, M)) for x in e]
    while sum(b) != total:
        give = sum(b) < total
        movable = [i for i in range(n) if (b[i] < M if give else b[i] > m)]
        if not movable:
            break
        j = max(movable, key=lambda i: (e[i], -i)) if give else min(movable, key=lambda i: (e[i], i))
        b[j] += 1 if give else -1
    return b


def profile(seed: int, n_layer: int) -> list[float]:
    e = np.random.default_rng(seed).dirichlet(np.full(n_layer, 0.7))
    e = [float(x) for x in np.round(e, 6)]
    e[-1] = round(1.0 - sum(e[:-1]), 6)                    # layer_scores must sum to 1
    return e


@pytest.mark.parametrize("seed,budget", [(0, 48), (1, 64), (2, 100)])
def test_compresskv_layer_budgets_are_algorithm_1_of_the_error_profile(seed, budget):
    n_layer = 6
    e = profile(seed, n_layer)
    obs = random_obs(seed, n_layer, 4, 2, 3 * budget + 50, w=32)
    want = algorithm_1(e, budget)
    assert sum(want) == budget * n_layer and len(set(want)) > 1
    for plan in engine_plans("compresskv", ["layer_scores=" + ",".join(map(repr, e))], budget, obs):
        assert plan.n_kept.tolist() == [[b, b] for b in want]
    rr = engine_plans("compresskv", ["layer_scores=" + ",".join(map(repr, e)), "allocator=round_robin"], budget,
                      obs)[0]
    assert int(rr.n_kept[:, 0].sum()) == budget * n_layer   # the code's allocator: the same total


def test_compresskv_only_the_retrieval_heads_vote_and_every_kv_head_keeps_their_choice():
    n_layer, n_head, n, w, budget = 3, 6, 240, 8, 40
    srh = [4, 1, 0, 5, 2, 3]                              # srh_k = 2 per layer, best first
    args = ["srh_k=2", "srh=" + ",".join(map(str, srh)), "window=8", "kernel=5", "pool=avg"]
    obs = random_obs(7, n_layer, n_head, 3, n, w=32)
    nat, ref = engine_plans("compresskv", args, budget, obs)
    for l in range(n_layer):
        heads = srh[2 * l:2 * l + 2]
        pooled = np_pool(obs.window_sum(w)[l, heads, :n - w].astype(np.float64), 5, "avg")
        want = np_top((pooled[0] + pooled[1]) / 2, budget - w) + list(range(n - w, n))
        for h in range(3):
            assert nat.kept(l, h).tolist() == want and ref.kept(l, h).tolist() == want
    # attention moved in a head that does not vote changes nothing; in one that votes, the choice
    other = random_obs(7, n_layer, n_head, 3, n, w=32)
    sums = other.window_sums.copy()
    sums[:, 0, 3] = sums[:, 0, 3, ::-1]                   # layer 0, query head 3: not one of its SRH (4, 1)
    other.window_sums = sums
    assert np.array_equal(engine_plans("compresskv", args, budget, other)[0].slots, nat.slots)
    sums[:, 0, 4] = sums[:, 0, 4, ::-1]                   # query head 4: its best SRH
    other.window_sums = sums
    moved = engine_plans("compresskv", args, budget, other)[0]
    assert moved.kept(0, 0).tolist() != nat.kept(0, 0).tolist()
    assert moved.kept(1, 0).tolist() == nat.kept(1, 0).tolist()


def test_compresskv_without_calibration_is_uniform_and_every_head_votes():
    obs = random_obs(8, 4, 4, 2, 200, w=32)
    for plan in engine_plans("compresskv", ["window=8", "kernel=1"], 32, obs):
        assert (plan.n_kept == 32).all()
        for l in range(4):
            score = obs.window_sum(8)[l, :, :192].astype(np.float64)
            mean = score[0]
            for q in range(1, 4):
                mean = mean + score[q]
            assert plan.kept(l, 1).tolist() == np_top(mean / 4, 24) + list(range(192, 200))
