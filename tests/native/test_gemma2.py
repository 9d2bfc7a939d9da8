"""gemma2 in the native engine: sliding-window layers (every other one, llama_kv_cache_iswa as gemma3) and
attention logit soft-capping (scores = cap * tanh(scores / cap), before the mask and kvcli's slot bias) plus
final logit soft-capping. Checked against the independent numpy pass of tests/native/npref.py (NpGemma) on a tiny
random gemma2 whose caps (4 and 8) are small enough to change every result (tests/native/conftest.py: tiny_gemma2,
4 layers, 0 and 2 slide over 16 tokens, 1 and 3 are global). The uncompressed cache and the identity plan are
checked on gemma2 as on gemma3 in test_iswa.py."""
from __future__ import annotations

import copy

import numpy as np
import pytest
from npref import apply_random_plan, assert_gemma_logits_close as _close, np_gemma, prompt_tokens


N = 48
OBS_WINDOW = 8


def _uncapped(ref):
    """The same numpy model without attention soft-capping: what a forgotten cap would compute."""
    out = copy.copy(ref)
    out.attn_cap = 0.0
    return out


def _err(got, want) -> float:
    return float(np.abs(np.asarray(got, np.float64) - want).max())


def test_gemma2_is_accepted_with_its_sliding_layers(session_factory, tiny_gemma2):
    s = session_factory(tiny_gemma2)
    i = s.info
    assert i.architecture == "gemma2"
    assert (i.n_layer, i.n_layer_model, i.kv_layers, i.sliding_layers, i.sliding_window) == (2, 4, (1, 3), (0, 2), 16)


def test_the_caps_change_the_logits(session_factory, tiny_gemma2):
    """The uncompressed cache matches numpy with the caps (test_iswa.py::test_uncompressed_cache_matches_numpy runs
    on gemma2 too); here: the caps are not idle, so that comparison would catch a cap kvcli dropped."""
    ref = np_gemma(tiny_gemma2)
    toks = prompt_tokens(N)
    s = session_factory(tiny_gemma2, cache_type="f32")
    s.prefill(toks)
    assert np.abs(ref.prefill(toks)[1]).max() < ref.final_cap   # the final cap bounds the logits
    assert _err(s.logits(), _uncapped(ref).prefill(toks)[1]) > 0.1   # the attention cap changes them


def _numpy_observation(ref, records, n, window):
    """Window sums [n_global, n_head, n] of the last `window` queries and column sums over all of them, from the
    per-token attention rows NpGemma recorded (row of the token at p: positions 0..p)."""
    win = np.zeros((len(ref.global_layers), ref.n_head, n))
    col = np.zeros_like(win)
    for p, rec in enumerate(records):
        for gi, probs in enumerate(rec):
            col[gi, :, : p + 1] += np.array(probs)
            if p >= n - window:
                win[gi, :, : p + 1] += np.array(probs)
    return win, col


@pytest.mark.parametrize("flash_attn", [False, True])
def test_observation_matches_numpy(session_factory, tiny_gemma2, flash_attn):
    """The window sums and column sums the planners read are computed from the soft-capped scores."""
    ref = np_gemma(tiny_gemma2)
    toks = prompt_tokens(N, 1)
    s = session_factory(tiny_gemma2, flash_attn=flash_attn, cache_type="f32")
    obs = s.prefill(toks, observe=("window", "colsum"), window=OBS_WINDOW)
    assert obs.positions.tolist() == list(range(N))
    records = []
    ref.prefill(toks, records)
    win, col = _numpy_observation(ref, records, N, OBS_WINDOW)
    # sums of 8 and 48 probability rows (measured: <= 3e-4 and 1e-3, the model's own f16 GELU table included)
    assert _err(obs.window_sums[0], win) <= 5e-3, _err(obs.window_sums[0], win)
    assert _err(obs.colsum, col) <= 5e-3, _err(obs.colsum, col)
    records = []
    _uncapped(ref).prefill(toks, records)
    assert _err(obs.window_sums[0], _numpy_observation(ref, records, N, OBS_WINDOW)[0]) > 0.1


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("flash_attn,path", [(False, "mask"), (True, "mask"), (True, "split")])
def test_random_plans_on_the_global_layers_match_numpy(session_factory, tiny_gemma2, monkeypatch, seed, flash_attn,
                                                        path):
    """Per-layer/per-head counts, merged rows and log(m) bias in the global layers (the bias added after the cap),
    through both of kvcli's attention paths for a compacted cache (the split path passes the cap to flash
    attention); then the observation of 8 more tokens over the compacted cache matches numpy's too."""
    monkeypatch.setenv("KVCLI_ATTN_PATH", path)
    ref = np_gemma(tiny_gemma2)
    s = session_factory(tiny_gemma2, flash_attn=flash_attn, cache_type="f32")
    plan, kv, entries = apply_random_plan(s, ref, N, seed)
    s.step({0: 1234})
    _close(s.logits(), ref.step(1234, N, kv, entries))
    assert s.attn_paths_taken() == [path, path]

    # 8 more tokens, observed: each attends to the compacted entries (+ their bias) and the tokens since
    more = prompt_tokens(OBS_WINDOW, seed + 10)
    _append(ref, kv, entries)
    obs2 = s.prefill(more, observe=("window",), window=OBS_WINDOW)
    B = plan.max_kept
    want = np.zeros((2, ref.n_head, B + 1 + OBS_WINDOW))
    logits = None
    for j, t in enumerate(more):
        rec = []
        logits = ref.step(t, N + 1 + j, kv, entries, record=rec)
        _append(ref, kv, entries)
        for gi, probs in enumerate(rec):
            for q in range(ref.n_head):
                n = int(plan.n_kept[gi, q // 2])
                want[gi, q, B - n:B] += probs[q][:n]                # the compacted block: right-aligned, plan order
                want[gi, q, B: B + 1 + j + 1] += probs[q][n:]       # the decoded token, then these tokens
    _close(s.logits(), logits)
    # slots are cells in cell order; in position order they are the block (positions N-B..N-1), then N, N+1, ...
    got = obs2.window_sums[0][..., np.argsort(obs2.positions)]
    assert _err(got, want) <= 5e-3, _err(got, want)


def _append(ref, kv, entries):
    """Add the last token's K/V (kv[il][-1]) to the compacted entries of every global layer, bias 0."""
    for gi, il in enumerate(ref.global_layers):
        _, k, v = kv[il][-1]
        for h in range(ref.n_head_kv):
            K, V, b = entries[gi][h]
            entries[gi][h] = (np.vstack([K, k[h][None]]), np.vstack([V, v[h][None]]), np.append(b, 0.0))
