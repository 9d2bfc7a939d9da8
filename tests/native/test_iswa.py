"""Models with sliding-window layers (gemma3; llama.cpp keeps those layers in the second cache of
llama_kv_cache_iswa): kvcli compresses the global layers' cache and leaves the window cache whole. Checked
against an independent numpy forward pass of a tiny random gemma3 (tests/native/npref.py, NpGemma): 4 layers,
layers 0 and 2 slide over 16 tokens, 1 and 3 are global."""
from __future__ import annotations

import numpy as np
import pytest
from npref import apply_random_plan, entries_from_plan, np_gemma, prompt_tokens, random_plan
from npref import assert_gemma_logits_close as _close

from kvcli.errors import KvcliError
from kvcli.native import cache
from kvcli.native.lib import native_plan
from kvcli.planning.formats import Plan

N = 48
WINDOW = 16


def test_the_plan_covers_the_global_layers(session_factory, tiny_gemma):
    s = session_factory(tiny_gemma)
    i = s.info
    assert (i.n_layer, i.n_layer_model, i.kv_layers, i.sliding_layers, i.sliding_window) == (2, 4, (1, 3), (0, 2), 16)
    obs = s.prefill(prompt_tokens(N), observe=("window", "colsum", "kv"), window=8).with_kv_arrays()
    assert obs.window_sums.shape == (1, 2, 4, N) and obs.colsum.shape == (2, 4, N)
    assert obs.keys.shape == (2, 2, N, 16)
    # each query's attention over the global layers' cells sums to one: 8 window queries, N queries in all
    np.testing.assert_allclose(obs.window_sums.sum(axis=-1), 8.0, rtol=1e-4)
    np.testing.assert_allclose(obs.colsum.sum(axis=-1), N, rtol=1e-4)


@pytest.mark.parametrize("model", ["tiny_gemma", "tiny_gemma2"])
@pytest.mark.parametrize("flash_attn", [False, True])
def test_uncompressed_cache_matches_numpy(session_factory, request, model, flash_attn):
    """gemma3, and gemma2 with its attention and final logit soft caps (tests/native/test_gemma2.py)."""
    path = request.getfixturevalue(model)
    ref = np_gemma(path)
    toks = prompt_tokens(N)
    s = session_factory(path, flash_attn=flash_attn, cache_type="f32")
    s.prefill(toks)
    kv, want = ref.prefill(toks)
    _close(s.logits(), want)
    s.step({0: 777})
    _close(s.logits(), ref.step(777, N, kv))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_plans_on_the_global_layers_match_numpy(session_factory, tiny_gemma, seed):
    """Per-layer/per-head counts, merged rows and log(m) bias in the global layers; the sliding layers still
    see their whole window: llama.cpp's next-token logits equal numpy's over exactly those entries."""
    ref = np_gemma(tiny_gemma)
    s = session_factory(tiny_gemma, flash_attn=False, cache_type="f32")
    plan, kv, entries = apply_random_plan(s, ref, N, seed)
    s.step({0: 1234})
    _close(s.logits(), ref.step(1234, N, kv, entries))

    st = s.stats()
    assert st["kv_cells"] == plan.max_kept + 1
    assert st["sliding_layers"] == [0, 2] and st["sliding_window"] == WINDOW
    for i, il in enumerate((1, 3)):
        assert st["per_layer_cells"][il] == plan.n_kept[i].max() + 1
        assert st["per_head_entries"][il] == [int(n) + 1 for n in plan.n_kept[i]]
    # the window cache keeps at least the window (llama.cpp drops older cells only when it needs room)
    assert all(WINDOW <= st["per_layer_cells"][il] <= N + 1 for il in (0, 2))
    assert st["sliding_cells"] == st["per_layer_cells"][0] and st["sliding_bytes"] > 0


@pytest.mark.parametrize("model", ["tiny_gemma", "tiny_gemma2"])
@pytest.mark.parametrize("flash_attn,cache_type", [(False, "f32"), (True, "f16"), (False, "f16")])
def test_identity_plan_keeps_the_greedy_continuation(session_factory, request, model, flash_attn, cache_type):
    path = request.getfixturevalue(model)
    toks = prompt_tokens(N)
    ref = session_factory(path, flash_attn=flash_attn, cache_type=cache_type)
    ref.prefill(toks)
    s = session_factory(path, flash_attn=flash_attn, cache_type=cache_type)
    s.prefill(toks)
    s.apply_plan(Plan.keep_all(2, 2, N))
    assert cache.is_compressed(s.ctx, 0)
    out_ref, out = [], []
    for _ in range(6):  # the global layers read through the slot bias, the sliding ones their window
        out_ref.append(int(np.argmax(ref.logits())))
        out.append(int(np.argmax(s.logits())))
        assert np.abs(s.logits() - ref.logits()).max() <= 1e-4
        ref.step({0: out_ref[-1]})
        s.step({0: out[-1]})
    assert out == out_ref


def test_snapkv_keeps_the_budget_and_decodes_past_the_window(session_factory, tiny_gemma):
    from kvcli import policies
    params = policies.prepare("snapkv", ["window=8"], 24)[1]
    s = session_factory(tiny_gemma)
    obs = s.prefill(prompt_tokens(120), observe=("window",), window=8)
    plan = native_plan("snapkv", params, 24, obs)
    s.apply_plan(plan)
    assert s.stats()["kv_cells"] == 24
    for _ in range(2 * WINDOW):
        s.step({0: int(np.argmax(s.logits()))})
    st = s.stats()
    assert st["kv_cells"] == 24 + 2 * WINDOW and np.isfinite(s.logits()).all()
    assert st["per_layer_cells"][1] == st["per_layer_cells"][3] == 24 + 2 * WINDOW


def test_state_of_a_compressed_sequence_round_trips(session_factory, tiny_gemma):
    """A saved state holds both caches: the compacted global one (with its slot bias) and the window."""
    s = session_factory(tiny_gemma)
    obs = s.prefill(prompt_tokens(N), observe=("kv",)).with_kv_arrays()
    s.apply_plan(random_plan(np.random.default_rng(5), 2, 2, N, 16, obs.keys, obs.values))
    snap = s.save_seq(0)
    t = session_factory(tiny_gemma)
    t.restore_seq(snap, 0)
    assert cache.is_compressed(t.ctx, 0)
    before, after = s.stats()["per_layer_cells"], t.stats()["per_layer_cells"]
    assert [after[1], after[3]] == [before[1], before[3]]
    # llama.cpp saves the window cache's cells that the next token can still see, not the older ones it held
    assert after[0] == after[2] == WINDOW < before[0]
    s.step({0: 99})
    t.step({0: 99})
    np.testing.assert_array_equal(t.logits(), s.logits())


def test_reindexing_is_refused_in_one_line(session_factory, tiny_gemma):
    s = session_factory(tiny_gemma)
    s.prefill(prompt_tokens(N))
    with pytest.raises(KvcliError, match="re-indexing .* not supported for models with sliding-window layers"):
        s.apply_plan(Plan.keep_all(2, 2, N), reindex=True)
    assert not cache.is_compressed(s.ctx, 0) and s.stats()["kv_cells"] == N


@pytest.mark.parametrize("model", ["tiny_gemma", "tiny_gemma2"])
def test_check_l1_runs_without_the_reference_engine(request, model):
    """L1 alone on the global layers' observation (L2/L3 against the reference engine:
    tests/reference/test_reference_architectures.py)."""
    from kvcli.drivers.check import CheckSettings, Thresholds, run_check
    path = request.getfixturevalue(model)
    doc = "The garden has three solar panels and a small pond with six fish. " * 20
    r = run_check(path, doc, ["snapkv", "pyramidkv"], CheckSettings(budget=64, n_tokens=4, levels=(1,)),
                  Thresholds.tight())
    assert r["passed"] and all(e["l1"]["pass"] and e["l1"]["identical_budgets"] for e in r["policies"])


def test_the_window_cache_stays_bounded_and_a_deep_rollback_is_refused(session_factory, tiny_gemma):
    """400 tokens through a window cache of 256 cells (llama.cpp: window + batch, rounded up to 256): it reuses
    the cells of the oldest positions, the compressed global layers still match numpy, and going back to a
    position whose window the cache no longer holds is refused."""
    n = 400
    ref = np_gemma(tiny_gemma)
    toks = prompt_tokens(n, 9)
    s = session_factory(tiny_gemma, n_ctx=512, n_batch=64, flash_attn=False, cache_type="f32")
    obs = s.prefill(toks, observe=("kv",)).with_kv_arrays()
    plan = random_plan(np.random.default_rng(9), 2, 2, n, 16, obs.keys, obs.values, merge=False)
    s.apply_plan(plan)
    st = s.stats()
    assert st["sliding_cells"] == 256 and st["kv_cells"] == plan.max_kept
    kv, _ = ref.prefill(toks)
    s.step({0: 4321})
    _close(s.logits(), ref.step(4321, n, kv, entries_from_plan(plan, obs.keys, obs.values)))
    with pytest.raises(KvcliError, match="the sliding-window layers' cache holds positions >= 145 only"):
        s.truncate(0, 100)
    s.truncate(0, n)   # back to before the decoded token: its window is held
    s.step({0: 4321})
    kv = [layer[:-1] for layer in kv]
    _close(s.logits(), ref.step(4321, n, kv, entries_from_plan(plan, obs.keys, obs.values)))


def test_packing_two_compressed_sequences_beside_the_window_cache(session_factory, tiny_gemma, monkeypatch):
    """kvcli batch on a sliding-window model: packing moves the global layers' cells only (positions travel with
    them, the window cache is untouched) and both sequences decode as under the cells layout."""
    def two(layout):
        monkeypatch.setenv("KVCLI_LAYOUT", layout)
        s = session_factory(tiny_gemma, flash_attn=True, cache_type="f16", n_seq=2)
        for seq, widths in ((0, [30, 8]), (1, [20, 14])):
            s.prefill(prompt_tokens(N, 7 + seq), seq=seq)
            kept = [[np.arange(N - w, N, dtype=np.int32) for _ in range(s.info.n_head_kv)] for w in widths]
            s.apply_plan(Plan.from_lists(kept), seq=seq)
        return s
    cells, ragged = two("cells"), two("ragged")
    assert cache.layout_fronts(ragged.ctx) == [0, 22]
    assert ragged.pack_cells() > 0
    assert cache.layout_fronts(ragged.ctx) == [0, 22 + 6]
    for t in (101, 202, 303):
        for s in (cells, ragged):
            s.step({0: t, 1: t + 1})
        for q in (0, 1):
            np.testing.assert_allclose(ragged.logits(q), cells.logits(q), atol=1e-4)
