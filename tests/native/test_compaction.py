"""Compaction of a sequence by a plan in the patched llama.cpp cache, checked against an
independent numpy forward pass over exactly the kept entries (tests/native/npref.py)."""
from __future__ import annotations

import numpy as np
import pytest
from npref import entries_from_plan, np_model, prompt_tokens, random_plan

from kvcli.errors import KvcliError
from kvcli.native import cache
from kvcli.planning.formats import Plan

N = 48


def _greedy(s, n, seq=0):
    out = []
    for _ in range(n):
        t = int(np.argmax(s.logits(seq)))
        out.append(t)
        s.step({seq: t})
    return out


# identity plan: f32 K/V are copied byte for byte, so the logits are bit-identical; we allow 1e-4.
# f16 / q8_0 / q4_0: still byte copies, same bound; the bias (all zero) goes through the f16 mask.
@pytest.mark.parametrize("flash_attn,cache_type,model", [
    (False, "f32", "tiny_model"), (True, "f32", "tiny_model"), (True, "f16", "tiny_model"),
    (False, "f16", "tiny_model"), (True, "q8_0", "tiny_model_64"), (True, "q4_0", "tiny_model_64"),
])
def test_identity_plan_keeps_logits_and_greedy_continuation(session_factory, request, flash_attn, cache_type, model):
    path = request.getfixturevalue(model)
    toks = prompt_tokens(N)
    ref = session_factory(path, flash_attn=flash_attn, cache_type=cache_type)
    ref.prefill(toks)
    s = session_factory(path, flash_attn=flash_attn, cache_type=cache_type)
    s.prefill(toks)
    s.apply_plan(Plan.keep_all(s.info.n_layer, s.info.n_head_kv, N))
    assert cache.is_compressed(s.ctx, 0)
    assert np.abs(s.logits() - ref.logits()).max() <= 1e-4
    # the decode graph now carries the slot bias: same logits, same greedy tokens
    s.step({0: 42})
    ref.step({0: 42})
    assert np.abs(s.logits() - ref.logits()).max() <= 1e-4
    assert _greedy(s, 8) == _greedy(ref, 8)
    np.testing.assert_array_equal(cache.seq_positions(s.ctx, 0), np.arange(N + 9))


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_plans_match_numpy_attention_over_kept_entries(session_factory, tiny_model, seed):
    """Per-layer/per-head counts, merged rows and log(m) bias: llama.cpp's next-token logits equal
    a numpy forward pass that attends to exactly the kept (or replaced) rows with their bias."""
    rng = np.random.default_rng(seed)
    ref = np_model(tiny_model)
    s = session_factory(tiny_model, flash_attn=False, cache_type="f32")
    obs = s.prefill(prompt_tokens(N, seed), observe=("kv",)).with_kv_arrays()
    plan = random_plan(rng, ref.n_layer, ref.n_head_kv, N, ref.head_dim, obs.keys, obs.values)
    assert plan.replace_entry.size > 0 and np.any(plan.log_mult != 0)
    assert len(set(plan.n_kept.reshape(-1).tolist())) > 1
    s.apply_plan(plan)
    assert cache.stats(s.ctx, 0, ref.n_layer, ref.n_head_kv)["n_cells"] == plan.max_kept

    entries = entries_from_plan(plan, obs.keys, obs.values)
    tok = 1234
    s.step({0: tok})  # the session's position counter: the token sits at position N
    want = ref.step(tok, N, entries)
    got = s.logits().astype(np.float64)
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    assert int(np.argmax(got)) == int(np.argmax(want))

    # the cache holds exactly those rows now: read back slot j of (l, h) for j < n_kept
    keys, values = cache.read_kv(s.ctx, 0, s.info)
    for l in range(plan.n_layer):
        for h in range(plan.n_head_kv):
            n = plan.n_kept[l, h]
            f = plan.first_slot(l, h, reindexed=False)   # right-aligned: dead slots first
            np.testing.assert_allclose(keys[l, h, f:f + n], entries[l][h][0], atol=1e-6)
            np.testing.assert_allclose(values[l, h, f:f + n], entries[l][h][1], atol=1e-6)


def test_random_plan_with_flash_attention(session_factory, tiny_model):
    """Flash attention: K/V go through f16 and the mask (with log(m)) is f16, so 2e-2 of the logit scale."""
    rng = np.random.default_rng(5)
    ref = np_model(tiny_model)
    s = session_factory(tiny_model, flash_attn=True, cache_type="f32")
    obs = s.prefill(prompt_tokens(N, 5), observe=("kv",)).with_kv_arrays()
    plan = random_plan(rng, ref.n_layer, ref.n_head_kv, N, ref.head_dim, obs.keys, obs.values)
    s.apply_plan(plan)
    s.step({0: 777})
    want = ref.step(777, N, entries_from_plan(plan, obs.keys, obs.values))
    assert np.abs(s.logits() - want).max() <= 2e-2 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("cache_type", ["q8_0", "q4_0"])
def test_quantised_cache_replacement_rows_are_requantised(session_factory, tiny_model_64, cache_type):
    """Replacement rows are written in the cache's type (and its Hadamard rotation): reading them
    back gives the requested row up to that type's quantisation error."""
    rng = np.random.default_rng(9)
    s = session_factory(tiny_model_64, flash_attn=True, cache_type=cache_type)
    obs = s.prefill(prompt_tokens(N, 9), observe=("kv",)).with_kv_arrays()
    plan = random_plan(rng, s.info.n_layer, s.info.n_head_kv, N, s.info.head_dim, obs.keys, obs.values)
    s.apply_plan(plan)
    keys, values = cache.read_kv(s.ctx, 0, s.info)
    offs = plan.offsets()
    tol = {"q8_0": 0.02, "q4_0": 0.25}[cache_type]
    for r, e in enumerate(plan.replace_entry):
        flat = int(np.searchsorted(offs.reshape(-1), e, side="right") - 1)
        l, h = divmod(flat, s.info.n_head_kv)
        j = plan.first_slot(l, h, reindexed=False) + e - offs[l, h]   # right-aligned: dead slots first
        scale = np.abs(plan.replace_k[r]).max()
        assert np.abs(keys[l, h, j] - plan.replace_k[r]).max() <= tol * scale
        assert np.abs(values[l, h, j] - plan.replace_v[r]).max() <= tol * np.abs(plan.replace_v[r]).max()
    # kept (not replaced) rows are byte copies: identical to what was read before
    rep = set(plan.replace_entry.tolist())
    for l in range(plan.n_layer):
        for h in range(plan.n_head_kv):
            f = plan.first_slot(l, h, reindexed=False)
            for j, slot in enumerate(plan.kept(l, h)):
                if offs[l, h] + j not in rep:
                    np.testing.assert_array_equal(keys[l, h, f + j], obs.keys[l, h, slot])


def test_stats_measure_the_compacted_cache(session_factory, tiny_model):
    rng = np.random.default_rng(3)
    s = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    s.prefill(prompt_tokens(N))
    info = s.info
    full = cache.stats(s.ctx, 0, info.n_layer, info.n_head_kv)
    row = info.n_head_kv * info.head_dim * 2  # f16 bytes of one layer's K (or V) in one cell
    assert full["n_cells"] == N and full["k_bytes"] == N * row * info.n_layer == full["v_bytes"]
    assert full["bias_bytes"] == 0 and full["live_entries"] == N * info.n_layer * info.n_head_kv
    plan = random_plan(rng, info.n_layer, info.n_head_kv, N, info.head_dim, merge=False)
    s.apply_plan(plan)
    st = cache.stats(s.ctx, 0, info.n_layer, info.n_head_kv)
    B = plan.max_kept
    # the ragged layout (native/src/kvcli_layout.cpp): each layer stores its widest KV head's entries, right-aligned
    # in the B cells, so layer l's first B - max_h n_kept[l, h] cells hold no row there
    widest = plan.n_kept.max(axis=1)
    assert cache.layout_fronts(s.ctx) == (B - widest).tolist() and (B - widest).max() > 0
    assert st["n_cells"] == B and st["k_bytes"] == int(widest.sum()) * row == st["v_bytes"]
    assert st["bias_bytes"] == B * info.n_layer * info.n_head_kv * 4
    assert st["live_entries"] == plan.entries()
    assert st["per_head_entries"] == plan.n_kept.tolist()
    assert st["per_layer_cells"] == plan.cells_per_layer()
    s.step({0: 5})
    st2 = cache.stats(s.ctx, 0, info.n_layer, info.n_head_kv)
    assert st2["n_cells"] == B + 1 and st2["live_entries"] == plan.entries() + info.n_layer * info.n_head_kv
    whole = cache.stats(s.ctx, -1, info.n_layer, info.n_head_kv)
    assert whole["n_cells"] == B + 1


def test_compacting_twice_and_removing_the_sequence(session_factory, tiny_model):
    """A compacted sequence can be compacted again; seq_rm frees its cells and clears its bias, so
    a fresh prompt in the same cells decodes like in a new context."""
    rng = np.random.default_rng(11)
    ref = np_model(tiny_model)
    s = session_factory(tiny_model, flash_attn=False, cache_type="f32")
    obs = s.prefill(prompt_tokens(N, 11), observe=("kv",)).with_kv_arrays()
    p1 = random_plan(rng, ref.n_layer, ref.n_head_kv, N, ref.head_dim, merge=False)
    s.apply_plan(p1)
    # second compaction over the compacted slots: keep the first half of each (l, h)'s entries
    n1 = p1.max_kept
    half = [[np.arange(max(1, p1.n_kept[l, h] // 2), dtype=np.int32) for h in range(ref.n_head_kv)]
            for l in range(ref.n_layer)]
    # the compacted slots of (l, h) are right-aligned: its j-th entry sits in slot first_slot + j
    kept2 = [[(p1.first_slot(l, h, reindexed=False) + half[l][h]).astype(np.int32) for h in range(ref.n_head_kv)]
             for l in range(ref.n_layer)]
    p2 = Plan.from_lists(kept2)
    assert cache.apply_plan(s.ctx, 0, p2, ref.head_dim) == p2.max_kept
    composed = Plan.from_lists([[p1.kept(l, h)[half[l][h]] for h in range(ref.n_head_kv)]
                                for l in range(ref.n_layer)])
    s.step({0: 99})
    want = ref.step(99, N, entries_from_plan(composed, obs.keys, obs.values))
    assert np.abs(s.logits() - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    assert n1 >= p2.max_kept

    s.clear(0)
    assert not cache.is_compressed(s.ctx, 0)
    toks = prompt_tokens(20, 12)
    s.prefill(toks)
    fresh = session_factory(tiny_model, flash_attn=False, cache_type="f32")
    fresh.prefill(toks)
    assert np.abs(s.logits() - fresh.logits()).max() <= 1e-5


@pytest.mark.parametrize("bad,msg", [
    (lambda p: setattr(p, "n_kept", p.n_kept[:1]), "n_kept and slots disagree"),
    (lambda p: p.slots.__setitem__(0, 10_000), "outside"),
    (lambda p: p.slots.__setitem__(slice(0, 2), [5, 3]), "ascending"),
])
def test_bad_plans_are_refused_with_clear_errors(session_factory, tiny_model, bad, msg):
    s = session_factory(tiny_model)
    s.prefill(prompt_tokens(N))
    p = Plan.keep_all(s.info.n_layer, s.info.n_head_kv, N)
    bad(p)
    with pytest.raises(KvcliError, match=msg):
        cache.apply_plan(s.ctx, 0, p, s.info.head_dim)
    assert not cache.is_compressed(s.ctx, 0)


def test_plan_for_another_model_shape_is_refused_natively(session_factory, tiny_model):
    import ctypes

    from kvcli.native.lib import lib, plan_view
    s = session_factory(tiny_model)
    s.prefill(prompt_tokens(N))
    p = Plan.keep_all(s.info.n_layer + 1, s.info.n_head_kv, N)
    view, _keep = plan_view(p, s.info.head_dim)
    assert lib().kvcli_apply_plan(s.ctx, 0, ctypes.byref(view)) < 0
    assert "does not match the model" in lib().last_error()
    with pytest.raises(KvcliError, match="keeps nothing"):
        cache.apply_plan(s.ctx, 0, Plan.keep_all(s.info.n_layer, s.info.n_head_kv, 0), s.info.head_dim)
