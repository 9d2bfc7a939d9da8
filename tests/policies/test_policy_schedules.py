"""Budget schedules against worked numbers, and hand-made cases whose kept sets are worked out here.

Every hand-made case runs through BOTH planners (C++ and torch).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from policy_obs import random_obs

import kvcli.policies as P
from kvcli.errors import KvcliError
from kvcli.native.lib import native_plan
from kvcli.planning.formats import Observation, sum_window_rows
from kvcli.policies.compresskv import allocate
from kvcli.policies.pyramidkv import layer_budgets as pyramid_budgets
from kvcli.policies.windowkv import group_budgets, group_size
from kvcli.reference.policies import reference_plan


def plans(name, args, budget, obs):
    _, params, _ = P.prepare(name, args, budget)
    nat, ref = native_plan(name, params, budget, obs), reference_plan(name, params, budget, obs)
    assert np.array_equal(nat.n_kept, ref.n_kept) and np.array_equal(nat.slots, ref.slots)
    return nat


def kept(plan, l=0, h=0):
    return plan.kept(l, h).tolist()


def obs_from_rows(rows: np.ndarray, n_head_kv: int = 1) -> Observation:
    """rows: window attention [n_layer, n_head, w, n], observed as the window sums of every length 1..w."""
    rows = np.ascontiguousarray(rows, np.float32)
    L, H, w, n = rows.shape
    windows = tuple(range(1, w + 1))
    return Observation(n_layer=L, n_head=H, n_head_kv=n_head_kv, head_dim=4, n=n,
                       window_sums=sum_window_rows(rows, windows), windows=windows)


# ---------------------------------------------------------------------------------------------
# WindowKV: the digest's table (authors' code, lambda = 14)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("m,gamma,B,expected", [
    (32, 8, 2048, [2926, 2341, 1756, 1170]),
    (32, 8, 1024, [1463, 1171, 879, 585]),
    (32, 8, 512, [732, 586, 440, 292]),
    (28, 7, 2048, [3072, 2390, 1708, 1024]),
    (28, 7, 1024, [1536, 1195, 854, 512]),
    (28, 7, 512, [768, 598, 428, 256]),
])
def test_windowkv_group_budgets_digest_table(m, gamma, B, expected):
    assert group_budgets(m, gamma, B, 14) == expected


def test_windowkv_group_size_and_edge_schedules():
    assert [group_size(m, 0) for m in (32, 28, 30, 1, 2, 7)] == [8, 7, 6, 1, 1, 1]
    assert group_size(30, 8) == 8
    assert group_budgets(30, 30, 512, 14) == [512]                  # one group: uniform
    assert group_budgets(30, 8, 96, 14) == [138, 110, 82, 54]       # 4 groups of 8, 8, 8, 6 layers
    assert group_budgets(4, 2, 4, 14) == [8, 0]                     # the last group keeps no review entry
    assert group_budgets(32, 16, 2048, 14) == [1756, 2340]          # gamma > lambda: inverted (digest)


def test_windowkv_layers_follow_the_group_schedule():
    # L = n - window and every group budget are multiples of review_window: whole windows fit exactly
    obs = random_obs(5, n_layer=6, n_head=4, n_head_kv=2, n=32 + 16 * 20, w=32)
    plan = plans("windowkv", ["task=aggregation", "review_window=16", "shared_layers=2", "beta=4"], 32 + 16 * 8, obs)
    bg = group_budgets(6, 2, 16 * 8, 4)
    assert bg == [192, 128, 64]
    assert plan.n_kept[:, 0].tolist() == [b + 32 for b in bg for _ in range(2)]
    assert (plan.n_kept == plan.n_kept[:, :1]).all()                # head-agnostic


def test_windowkv_handmade_mean_vs_topp():
    # n = 12, window alpha = 2, review_window 2: review context [0, 10) = five windows; budget 6 keeps two
    n = 12
    rows = np.zeros((1, 1, 2, n), np.float32)
    rows[0, 0, 0, 10] = 1.0
    t = [0.05, 0.05, 0.3, 0.0, 0.1, 0.1, 0.02, 0.2, 0.15, 0.15]
    rows[0, 0, 1, :10] = t
    rows[0, 0, 1, 10:] = (1 - sum(t)) / 2
    obs = obs_from_rows(rows)
    base = ["window=2", "review_window=2"]
    # mean: W1 = (.3 + 0)/2 = .15 ties W4 = (.15 + .15)/2; W3 = .11, W2 = .1, W0 = .05 -> W1, W4
    assert kept(plans("windowkv", base + ["score=mean"], 6, obs)) == [2, 3, 8, 9, 10, 11]
    # top-1: W1 .3, W3 .2, W4 .15 -> W1, W3
    assert kept(plans("windowkv", base + ["score=topp", "top_p=1"], 6, obs)) == [2, 3, 6, 7, 10, 11]
    # budget 5: review budget 3 -> drop ceil(7/2) = 4 windows, keep one (W1 wins the tie with W4: lower window)
    assert kept(plans("windowkv", base + ["score=mean"], 5, obs)) == [2, 3, 10, 11]


def test_windowkv_group_leaders_choose_for_their_group():
    n = 12
    rows = np.zeros((4, 1, 2, n), np.float32)
    rows[:, 0, 0, 10] = 1.0
    pick = {0: [0, 1], 1: [8, 9], 2: [4, 5], 3: [2, 3]}      # the slots each layer's own attention prefers
    for l, slots in pick.items():
        rows[l, 0, 1, slots] = 0.4
        rows[l, 0, 1, 11] = 0.2
    obs = obs_from_rows(rows)
    # 4 layers, groups {0, 1} and {2, 3}; beta = 2 makes both group budgets 4 review entries = 2 windows
    plan = plans("windowkv", ["window=2", "review_window=2", "shared_layers=2", "beta=2"], 6, obs)
    # the leader's best window, then the tie between the four 0.0 windows goes to the lowest
    assert kept(plan, 0) == kept(plan, 1) == [0, 1, 2, 3, 10, 11]
    assert kept(plan, 2) == kept(plan, 3) == [0, 1, 4, 5, 10, 11]


# ---------------------------------------------------------------------------------------------
# PyramidKV: KVCache-Factory's schedule
# ---------------------------------------------------------------------------------------------
def test_pyramidkv_schedule_worked_numbers():
    # base = 512 - 8 = 504, min = 504 // 20 = 25, max = 2 * 504 - 25 = 983, step = 958 // 31 = 30
    b = pyramid_budgets(32, 4096, 512, 8, 20, "factory")
    assert b[:3] == [983, 953, 923] and b[-1] == 983 - 31 * 30 == 53
    assert sum(b) == 16576 and 32 * 504 == 16128                     # the floor makes the total larger
    e = pyramid_budgets(32, 4096, 512, 8, 20)                        # the default: exact
    assert sum(e) == 16128 and e[0] == 983 and e[-1] == 25
    assert all(x >= y for x, y in zip(e, e[1:]))
    # middle-length prompts (n < 2 * base) use SnapKV's uniform budget
    assert pyramid_budgets(32, 1000, 512, 8, 20) == [504] * 32
    # max capped to n - window: max = 1002, min = 2 * 504 - 1002 = 6, step = 996 // 31 = 32
    b = pyramid_budgets(32, 1010, 512, 8, 1000, "factory")
    assert b[0] == 1002 and b[1] == 970 and b[-1] == 1002 - 31 * 32
    assert pyramid_budgets(1, 4096, 512, 8, 20) == [504]


@pytest.mark.parametrize("schedule", ["factory", "exact"])
def test_pyramidkv_layers_follow_the_schedule(schedule):
    obs = random_obs(11, n_layer=32, n_head=2, n_head_kv=1, n=2000, w=8)
    plan = plans("pyramidkv", [f"schedule={schedule}"], 256, obs)
    # base 248: min 12, max 484, step 472 // 31 = 15 (factory)
    expected = [b + 8 for b in pyramid_budgets(32, 2000, 256, 8, 20, schedule)]
    assert plan.n_kept[:, 0].tolist() == expected
    if schedule == "factory":
        assert expected[0] == 492 and expected[1] == 477
    else:
        assert plan.entries() == 256 * 32


# ---------------------------------------------------------------------------------------------
# Hand-made SnapKV, H2O, StreamingLLM, DynamicKV cases
# ---------------------------------------------------------------------------------------------
def snap_rows():
    # 1 layer, 2 query heads sharing 1 KV head, n = 8, window 2 (queries at slots 6 and 7)
    rows = np.zeros((1, 2, 2, 8), np.float32)
    rows[0, 0, 0] = [.1, .2, 0, .3, 0, 0, .4, 0]
    rows[0, 0, 1] = [.1, 0, .1, 0, 0, .2, .3, .3]
    rows[0, 1, 0] = [0, .2, 0, 0, .4, 0, .4, 0]
    rows[0, 1, 1] = [0, 0, .1, 0, 0, 0, .4, .5]
    return obs_from_rows(rows)


def test_snapkv_handmade():
    obs = snap_rows()
    base = ["window=2", "kernel=1"]
    # summed over the window: head 0 [.2 .2 .1 .3 0 .2], head 1 [0 .2 .1 0 .4 0]; mean [.1 .2 .1 .15 .2 .1]
    assert kept(plans("snapkv", base, 4, obs)) == [1, 4, 6, 7]
    assert kept(plans("snapkv", base, 3, obs)) == [1, 6, 7]          # tie .2 at slots 1 and 4: lower slot
    # max over the group: [.2 .2 .1 .3 .4 .2]
    assert kept(plans("snapkv", base + ["gqa=max"], 3, obs)) == [4, 6, 7]
    assert kept(plans("snapkv", base + ["gqa=max"], 4, obs)) == [3, 4, 6, 7]
    # max pooling (kernel 3) per query head, then mean: [.2 .2 .25 .35 .35 .3]
    assert kept(plans("snapkv", ["window=2", "kernel=3", "pool=max"], 4, obs)) == [3, 4, 6, 7]


def test_h2o_handmade():
    colsum = np.array([[[5, 1, 3, 3, .5, 2, 1, 1]]], np.float32)
    obs = Observation(n_layer=1, n_head=1, n_head_kv=1, head_dim=4, n=8, colsum=colsum)
    assert kept(plans("h2o", ["recent=2"], 4, obs)) == [0, 2, 6, 7]  # 3 at slots 2 and 3: lower slot
    assert kept(plans("h2o", ["recent=2"], 5, obs)) == [0, 2, 3, 6, 7]


def test_streamingllm_handmade():
    obs = Observation(n_layer=2, n_head=2, n_head_kv=1, head_dim=4, n=10)
    plan = plans("streamingllm", ["sinks=2"], 5, obs)
    assert kept(plan, 0) == kept(plan, 1) == [0, 1, 7, 8, 9]
    assert kept(plans("streamingllm", ["sinks=0"], 3, obs)) == [7, 8, 9]


def test_dynamickv_handmade_moves_budget_to_the_layer_that_needs_it():
    # 2 layers, 1 head, window 1, n = 7: prefix P = 6, budget 3 -> base 2, total 4 prefix entries
    rows = np.zeros((2, 1, 1, 7), np.float32)
    rows[0, 0, 0] = [.3, .25, .2, .15, .01, .01, .08]     # layer 0 attends to the prefix
    rows[1, 0, 0] = [.02, .01, .01, .01, .01, .01, .93]   # layer 1 hardly does
    obs = obs_from_rows(rows)
    # one update (the last layer): the global top-4 all sit in layer 0 -> counts [4, 0] // 2 = [2, 0];
    # Z = [6, 0] (bmax = min(10 * 2, 6) = 6), r = 6 / 4, Z' = [4, 0]: layer 0 keeps 4, layer 1 none
    plan = plans("dynamickv", ["window=1", "kernel=1"], 3, obs)
    assert kept(plan, 0) == [0, 1, 2, 3, 6]
    assert kept(plan, 1) == [6]
    assert plan.entries() - 2 == 2 * 2                    # prefix entries = base x n_layer


def test_dynamickv_total_never_exceeds_the_budget():
    for seed in range(3):
        obs = random_obs(seed, n_layer=7, n_head=6, n_head_kv=2, n=300, w=8)
        plan = plans("dynamickv", ["interval=3"], 64, obs)
        per_layer = plan.n_kept[:, 0]
        assert (plan.n_kept == per_layer[:, None]).all()           # same count for every head of a layer
        assert per_layer.sum() <= 64 * 7 and per_layer.min() >= 8  # the window is always kept
        assert len(set(per_layer.tolist())) > 1                    # budgets really differ per layer


# ---------------------------------------------------------------------------------------------
# CompressKV: the allocator against the digest's test vectors (authors' released profiles)
# ---------------------------------------------------------------------------------------------
# The design digest's vectors (methods/compresskv_allocator_vectors.json), copied next to this test:
# the authors' released per-layer profiles and the budgets their allocator gives at 256 tokens/layer.
_V = json.loads(Path(__file__).with_name("compresskv_allocator_vectors.json").read_text())["models"]


@pytest.mark.parametrize("model", sorted(_V))
@pytest.mark.parametrize("mode", ["paper", "round_robin"])
def test_compresskv_allocator_vectors(model, mode):
    mv = _V[model]
    got = allocate(mv["avg_score"], mv["budget_per_layer"], mv["min"], mv["max"] // mv["budget_per_layer"], mode)
    expected = list(mv["expected"]["round_robin"])
    if mode == "paper" and model.startswith("Mistral"):
        expected[1], expected[3] = 125, 152      # "same list except layer 1 = 125 and layer 3 = 152"
    assert got == expected and sum(got) == 256 * len(got)


@pytest.mark.parametrize("mode", ["paper", "round_robin"])
def test_compresskv_native_layers_follow_the_allocator(mode):
    mv = _V["Mistral-7B-Instruct-v0.3"]
    obs = random_obs(4, n_layer=32, n_head=2, n_head_kv=1, n=900, w=8)
    scores = "layer_scores=" + ",".join(map(repr, mv["avg_score"]))
    plan = plans("compresskv", [scores, f"allocator={mode}"], 256, obs)
    expected = allocate(mv["avg_score"], 256, 32, 3, mode)
    assert plan.n_kept[:, 0].tolist() == expected and plan.entries() == 256 * 32


def test_compresskv_handmade_srh_vote():
    # 1 layer, 4 query heads over 2 KV heads, n = 8, window 2, kernel 1, budget 3: one prefix slot kept,
    # the same for both KV heads. Heads 1 and 2 (the SRH) look at slot 4; the others at slot 0.
    rows = np.zeros((1, 4, 2, 8), np.float32)
    rows[0, :, :, 6:] = 0.25
    for q, slot in ((0, 0), (1, 4), (2, 4), (3, 0)):
        rows[0, q, :, slot] = 0.5
    obs = obs_from_rows(rows, n_head_kv=2)
    base = ["window=2", "kernel=1"]
    assert kept(plans("compresskv", base + ["srh_k=2", "srh=1,2"], 3, obs)) == [4, 6, 7]
    plan = plans("compresskv", base, 3, obs)        # no calibration: every head votes, tie -> lower slot
    assert kept(plan, 0, 0) == kept(plan, 0, 1) == [0, 6, 7]
    with pytest.raises(KvcliError, match=r"srh names query head 9, the model has 4"):
        native_plan("compresskv", P.prepare("compresskv", ["window=2", "srh_k=2", "srh=1,9"], 3)[1], 3, obs)
    with pytest.raises(KvcliError, match=r"srh has 3 head ids, expected 1 layers x srh_k 2"):
        native_plan("compresskv", P.prepare("compresskv", ["window=2", "srh_k=2", "srh=1,2,3"], 3)[1], 3, obs)
    with pytest.raises(KvcliError, match=r"srh has 3 head ids"):
        reference_plan("compresskv", ["window=2", "srh_k=2", "srh=1,2,3"], 3, obs)
