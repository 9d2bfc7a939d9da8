"""The reference engine's repeated compaction and position re-indexing (chunked prefill, issue #10).

Each property is checked against an independent computation: the raw (pre-RoPE) K rows captured from
the model's k_proj and rotated in numpy at the new positions, RoPE's invariance under a common shift,
a single compaction with the composed plan, and the masked full cache for observations.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcli.errors import KvcliError
from kvcli.planning.formats import Plan
from kvcli.reference.attention import hf_to_gguf_dims
from kvcli.reference.session import ReferenceSession

PROMPT = ("<|im_start|>user\nThe lighthouse keeper counted ships every night and wrote their names in a "
          "book, then slept until the gulls woke him.<|im_end|>\n<|im_start|>assistant\n")
N_LAYER, N_HEAD, N_KV, D = 3, 4, 2, 16    # the tiny model of tests/reference/conftest.py


def _subsets(n, counts, seed=0):
    """Random ascending slot lists, counts[l][h] of them per (layer, KV head)."""
    rng = np.random.default_rng(seed)
    return [[np.sort(rng.choice(n, size=c, replace=False)).astype(np.int32) for c in layer] for layer in counts]


def _greedy(session, steps=3, feed=None):
    """Logits before each of `steps` decoded tokens and after the last one; `feed` forces the tokens."""
    seen, fed = [], []
    for i in range(steps):
        seen.append(session.logits())
        tok = int(np.argmax(seen[-1])) if feed is None else feed[i]
        fed.append(tok)
        session.step({0: tok})
    seen.append(session.logits())
    return seen, fed


def _rope_hf(k, pos, theta=10000.0):
    """Fresh RoPE in float64 on rows in transformers' order (pairs (j, j + d/2)): k [..., d], pos [...]."""
    d = k.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(pos, np.float64)[..., None] * inv
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    half = np.concatenate([-k[..., d // 2:], k[..., : d // 2]], -1)
    return k * cos + half * sin


def _rope_llama_cpp(k, pos, theta=10000.0):
    """Fresh RoPE as llama.cpp's "normal" mode computes it, on rows in its order (adjacent pairs (2j, 2j+1))."""
    d = k.shape[-1]
    ang = np.asarray(pos, np.float64)[..., None] * theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    x0, x1 = k[..., 0::2], k[..., 1::2]
    out = np.empty_like(k)
    out[..., 0::2] = x0 * np.cos(ang) - x1 * np.sin(ang)
    out[..., 1::2] = x0 * np.sin(ang) + x1 * np.cos(ang)
    return out


def test_reindexed_keys_equal_a_fresh_rotation_at_the_new_positions(tiny_gguf):
    """A (layer, KV head) keeping k of B = 11 entries holds them right-aligned: slots B-k..B-1 with keys
    freshly rotated at positions B-k..B-1, zero rows (dead padding) in slots 0..B-k-1."""
    ref = ReferenceSession(tiny_gguf)
    toks = ref.tokenize(PROMPT)
    n = len(toks)
    raw = {}
    hooks = [layer.self_attn.k_proj.register_forward_hook(
        lambda mod, inp, out, l=l: raw.__setitem__(l, out[0].reshape(-1, N_KV, D).transpose(0, 1).double().numpy()))
        for l, layer in enumerate(ref.model.model.layers)]
    try:
        ref.prefill(toks)
    finally:
        for h in hooks:
            h.remove()
    counts = [[11, 7], [11, 11], [4, 9]]             # heads and layers keep different counts; B = 11
    kept = _subsets(n, counts)
    ref.apply_plan(Plan.from_lists(kept), reindex=True)
    st = ref.seq(0)
    assert st.next_pos == 11 and ref.stats()["kv_cells"] == 11
    for l in range(N_LAYER):
        keys = st.cache.layers[l].keys[0].double().numpy()            # [n_kv, B, d], transformers' order
        assert keys.shape == (N_KV, 11, D)
        for h in range(N_KV):
            k = counts[l][h]
            want = _rope_hf(raw[l][h, kept[l][h]], np.arange(11 - k, 11))
            np.testing.assert_allclose(keys[h, 11 - k:], want, atol=1e-5, rtol=0)
            assert (keys[h, :11 - k] == 0).all()                       # dead padding first, as in the native cache
    assert [[p.tolist() for p in layer] for layer in ref.kept_positions()] == \
        [[list(range(11 - c, 11)) for c in layer] for layer in counts]
    # the observation reports K in llama.cpp's order: it equals llama.cpp's own rotation of the raw rows
    obs = ref.prefill(ref.tokenize(" and"), observe=("kv",))
    assert obs.n == 12 and obs.positions.tolist() == list(range(12))
    for l in range(N_LAYER):
        for h in range(N_KV):
            k = counts[l][h]
            raw_gguf = hf_to_gguf_dims(torch.from_numpy(raw[l][h, kept[l][h]])).numpy()
            np.testing.assert_allclose(obs.keys[l, h, 11 - k:11], _rope_llama_cpp(raw_gguf, np.arange(11 - k, 11)),
                                       atol=1e-5, rtol=0)
            assert (obs.keys[l, h, :11 - k] == 0).all()


def test_reindexing_a_common_suffix_is_a_shift_attention_does_not_see(tiny_gguf):
    """Keeping the last k tokens in every head and re-indexing them to 0..k-1 (B = k: no padding) shifts every key and
    the next
    queries by the same n - k: RoPE attention depends only on differences, so the logits are unchanged."""
    a, b = ReferenceSession(tiny_gguf), ReferenceSession(tiny_gguf)
    toks = a.tokenize(PROMPT)
    n, k = len(toks), 12
    for s in (a, b):
        s.prefill(toks)
    suffix = [[np.arange(n - k, n, dtype=np.int32)] * N_KV for _ in range(N_LAYER)]
    a.apply_plan(Plan.from_lists(suffix))
    b.apply_plan(Plan.from_lists(suffix), reindex=True)
    assert a.seq(0).next_pos == n and b.seq(0).next_pos == k
    assert a.kept_positions()[0][0].tolist() == list(range(n - k, n))
    assert b.kept_positions()[0][0].tolist() == list(range(k))
    la, fed = _greedy(a, 4)
    lb, _ = _greedy(b, 4, feed=fed)
    for x, y in zip(la[1:], lb[1:]):
        np.testing.assert_allclose(x, y, atol=1e-4)
    assert b.kept_positions()[1][1].tolist() == list(range(k + 4))    # decoding went on at k, k+1, ...
    # while a different shift per head is no common shift: the logits change
    c = ReferenceSession(tiny_gguf)
    c.prefill(toks)
    c.apply_plan(Plan.from_lists([[np.arange(n - k, n, dtype=np.int32), np.arange(n - k + 3, n, dtype=np.int32)]
                                  for _ in range(N_LAYER)]), reindex=True)
    c.step({0: fed[0]})
    assert np.abs(c.logits() - la[1]).max() > 1e-3


@pytest.mark.parametrize("reindex", [False, True])
def test_two_compactions_equal_one_with_the_composed_plan(tiny_gguf, reindex):
    """Compacting twice equals compacting once with the composed plan: biases add (log(2) then log(3) is
    log(6)), rotations compose. Without re-indexing the second plan also picks dead padding slots: they
    stay dead. (With re-indexing a dead pick would take a position, so that case keeps live slots only;
    re-indexed, a (l, h) keeping k of B entries holds them right-aligned in slots B-k..B-1, positions
    B-k..B-1, so the second plan's slots are shifted by B1 - k there.)"""
    a, b = ReferenceSession(tiny_gguf), ReferenceSession(tiny_gguf)
    toks = a.tokenize(PROMPT)
    n = len(toks)
    for s in (a, b):
        s.prefill(toks)
    counts1 = [[14, 10], [14, 14], [8, 12]]           # B1 = 14
    kept1 = _subsets(n, counts1, seed=1)
    lm1 = [[np.where(np.arange(c) % 3 == 0, math.log(2.0), 0.0).astype(np.float32) for c in layer]
           for layer in counts1]
    a.apply_plan(Plan.from_lists(kept1, log_mult=lm1), reindex=reindex)
    # second plan over a's 14 slots: heads with fewer than 14 entries get dead padding slots picked too
    kept2 = [[np.array([0, 2, 3, 6, 9, 12, 13], np.int32), np.array([1, 4, 5, 8, 11, 13], np.int32)],
             [np.array([0, 1, 5, 7], np.int32), np.array([2, 3, 10, 12, 13], np.int32)],
             [np.array([1, 3, 7, 9, 10], np.int32), np.array([0, 6, 11], np.int32)]]
    # the same live entries in both kinds: entry j of a (l, h) keeping c sits in slot B1 - c + j (right-aligned)
    kept2 = [[(k[k < c] + 14 - c).astype(np.int32) for k, c in zip(layer, cl)] for layer, cl in zip(kept2, counts1)]
    lm2 = [[np.where(np.arange(len(k)) == 0, math.log(3.0), 0.0).astype(np.float32) for k in layer]
           for layer in kept2]
    a.apply_plan(Plan.from_lists(kept2, log_mult=lm2), reindex=reindex)
    kept_c, lm_c = [], []                             # the composed plan, applied to b in one go
    for l in range(N_LAYER):
        # entry index (in kept1 order) of each slot plan 2 picks: slot B1 - c + j
        ent = [kept2[l][h] - (14 - counts1[l][h]) for h in range(N_KV)]
        live = [(ent[h] >= 0) & (ent[h] < counts1[l][h]) for h in range(N_KV)]
        kept_c.append([kept1[l][h][ent[h][live[h]]] for h in range(N_KV)])
        lm_c.append([lm1[l][h][ent[h][live[h]]] + lm2[l][h][live[h]] for h in range(N_KV)])
    b.apply_plan(Plan.from_lists(kept_c, log_mult=lm_c), reindex=reindex)
    pa, pb = a.kept_positions(), b.kept_positions()
    B2 = max(k.size for layer in kept_c for k in layer)
    for l in range(N_LAYER):
        for h in range(N_KV):
            want = np.arange(B2 - kept_c[l][h].size, B2) if reindex else kept_c[l][h]
            assert pa[l][h].tolist() == pb[l][h].tolist() == want.tolist()
    if reindex:
        assert a.seq(0).next_pos == b.seq(0).next_pos == B2
    else:   # a's layer 2 head 0 picked 5 slots, 2 of them dead padding: 3 live entries, as b's
        assert a.stats()["kv_cells"] == b.stats()["kv_cells"] == 7 and a.seq(0).next_pos == n
        assert int(np.isfinite(a.seq(0).slots[2].bias[0].numpy()).sum()) == kept_c[2][0].size == 3
    la, fed = _greedy(a, 3)
    lb, _ = _greedy(b, 3, feed=fed)
    for x, y in zip(la, lb):
        np.testing.assert_allclose(x, y, atol=1e-4)


def test_observing_a_compressed_sequence_equals_the_masked_full_cache(tiny_gguf):
    """A compacted sequence is observed over its current slots, bias included: each kept slot gets what its
    entry gets in a full cache whose other entries are masked, dead padding slots get 0, and new tokens
    come at slots B, B+1, ... (the native layout: every layer padded to the model's widest head)."""
    a, b = ReferenceSession(tiny_gguf), ReferenceSession(tiny_gguf)
    toks = a.tokenize(PROMPT)
    n = len(toks)
    for s in (a, b):
        s.prefill(toks)
    counts = [[10, 6], [5, 5], [3, 8]]                 # B = 10; layer 1 holds 5 slots' worth of entries
    kept = _subsets(n, counts, seed=2)
    lm = [[np.where(np.arange(c) == 1, math.log(2.0), 0.0).astype(np.float32) for c in layer] for layer in counts]
    a.apply_plan(Plan.from_lists(kept, log_mult=lm))
    mask = [[np.full(n, -np.inf, np.float32) for _ in layer] for layer in kept]
    for l in range(N_LAYER):
        for h in range(N_KV):
            mask[l][h][kept[l][h]] = lm[l][h]
    b.apply_plan(Plan.from_lists([[np.arange(n, dtype=np.int32)] * N_KV for _ in range(N_LAYER)], log_mult=mask))
    assert a.stats()["kv_cells"] == 10 and a.stats()["per_layer_cells"] == [10, 5, 8]
    more = a.tokenize(" The gulls were loud.")
    m, w = len(more), 4
    oa = a.prefill(more, observe=("window", "colsum", "kv"), window=w)
    ob = b.prefill(more, observe=("window", "colsum", "kv"), window=w)
    assert oa.n == 10 + m and ob.n == n + m
    assert oa.positions.tolist() == list(range(n - 10, n + m))       # the native cells' positions
    assert a.stats()["per_layer_cells"] == [10 + m, 5 + m, 8 + m]
    group = N_HEAD // N_KV
    for l in range(N_LAYER):
        for q in range(N_HEAD):
            k = kept[l][q // group]
            f = 10 - k.size   # right-aligned in the 10 cells: dead slots first
            np.testing.assert_allclose(oa.window_sums[0, l, q, f:10], ob.window_sums[0, l, q, k], atol=w * 1e-6)
            np.testing.assert_allclose(oa.colsum[l, q, f:10], ob.colsum[l, q, k], atol=1e-5)
            assert (oa.window_sums[0, l, q, :f] == 0).all() and (oa.colsum[l, q, :f] == 0).all()
            np.testing.assert_allclose(oa.window_sums[0, l, q, 10:], ob.window_sums[0, l, q, n:], atol=w * 1e-6)
            np.testing.assert_allclose(oa.colsum[l, q, 10:], ob.colsum[l, q, n:], atol=1e-5)
        for h in range(N_KV):
            f = 10 - kept[l][h].size
            np.testing.assert_allclose(oa.keys[l, h, f:10], ob.keys[l, h, kept[l][h]], atol=1e-6)
            assert (oa.keys[l, h, :f] == 0).all() and (oa.values[l, h, :f] == 0).all()
    np.testing.assert_allclose(a.logits(), b.logits(), atol=1e-4)


def test_reindexing_is_refused_after_a_compaction_without_it(tiny_gguf):
    ref = ReferenceSession(tiny_gguf)
    toks = ref.tokenize(PROMPT)
    n = len(toks)
    ref.prefill(toks)
    ref.apply_plan(Plan.keep_all(N_LAYER, N_KV, n), reindex=True)     # fresh: allowed, positions unchanged
    ref.apply_plan(Plan.keep_all(N_LAYER, N_KV, n))                   # compacting again is allowed
    with pytest.raises(KvcliError, match="without re-indexing"):
        ref.apply_plan(Plan.keep_all(N_LAYER, N_KV, n), reindex=True)
