"""The reference engine on models with sliding-window layers (tiny random gemma3 and gemma2: 4 layers, layers 0
and 2 slide over 16 tokens, 1 and 3 are global; gemma2 soft-caps its attention scores and logits), checked against
the independent numpy forward pass of tests/native/npref.py (NpGemma): the sliding layers attend over their window
only, plans, observations and compaction cover the global layers only, as in the native engine
(tests/native/test_iswa.py, test_gemma2.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kvcli.errors import KvcliError
from kvcli.planning.formats import Plan
from kvcli.reference.session import ReferenceSession

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "native"))
from npref import apply_random_plan, np_gemma, prompt_tokens  # noqa: E402

N = 48
WINDOW = 16


@pytest.fixture(scope="module", params=["gemma3", "gemma2"])
def tiny_gemma(tmp_path_factory, request):
    from kvcli.testing.tiny_gguf import write_tiny
    return write_tiny(tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf", request.param, n_layer=4,
                      n_head=4, n_head_kv=2, head_dim=16, sliding_window=WINDOW, swa_pattern=2, seed=3)


def _close(got, want):
    # both in float32/float64 with the same tanh GELU: float32 accuracy
    assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_transformers_config_follows_llama_cpp(tiny_gemma):
    """Which layers slide, the window, the Q scale, the RoPE bases and the soft-caps as llama.cpp reads the file
    (transformers' own GGUF mapping makes every layer of the gemma3 sliding, scales Q by 1/sqrt(256) and gives
    gemma2 Gemma 2's caps, 50 and 30)."""
    cfg = ReferenceSession(tiny_gemma).model.config
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2
    assert cfg.sliding_window == WINDOW and cfg.query_pre_attn_scalar == 16
    if cfg.model_type == "gemma2":
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (4.0, 8.0)
    else:
        assert cfg.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
        assert cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None


def test_logits_match_numpy_past_the_window(tiny_gemma):
    ref = np_gemma(tiny_gemma)
    toks = prompt_tokens(N)
    s = ReferenceSession(tiny_gemma)
    s.prefill(toks)
    kv, want = ref.prefill(toks)
    _close(s.logits(), want)
    for pos, tok in enumerate((777, 5, 1234), start=N):
        s.step({0: tok})
        _close(s.logits(), ref.step(tok, pos, kv))


def test_observation_covers_the_global_layers(tiny_gemma):
    """The window sums and column sums of the global layers are numpy's attention probabilities (gemma2: of the
    soft-capped scores) summed."""
    s = ReferenceSession(tiny_gemma)
    toks = prompt_tokens(N)
    obs = s.prefill(toks, observe=("window", "colsum", "kv"), window=8)
    assert (obs.n_layer, obs.n) == (2, N)
    assert obs.window_sums.shape == (1, 2, 4, N) and obs.colsum.shape == (2, 4, N) and obs.keys.shape == (2, 2, N, 16)
    records = []
    np_gemma(tiny_gemma).prefill(toks, records)
    probs = np.zeros((N, 2, 4, N))       # [query, global layer, head, key]
    for pos, rec in enumerate(records):
        probs[pos, :, :, : pos + 1] = np.array(rec)
    np.testing.assert_allclose(obs.colsum, probs.sum(axis=0), atol=1e-5)
    np.testing.assert_allclose(obs.window_sums[0], probs[N - 8:].sum(axis=0), atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_plans_on_the_global_layers_match_numpy(tiny_gemma, seed):
    """Per-layer/per-head counts, merged rows and log(m) bias in the global layers; the sliding layers still see
    their whole window, and keep it while decoding on."""
    ref = np_gemma(tiny_gemma)
    s = ReferenceSession(tiny_gemma)
    plan, kv, entries = apply_random_plan(s, ref, N, seed)
    s.step({0: 1234})
    _close(s.logits(), ref.step(1234, N, kv, entries))

    st = s.stats()
    assert st["kv_cells"] == plan.max_kept + 1 and st["sliding_layers"] == [0, 2] and st["sliding_window"] == WINDOW
    for i, il in enumerate((1, 3)):
        assert st["per_layer_cells"][il] == plan.n_kept[i].max() + 1
    # the sliding layers keep every entry (the window is the attention mask's)
    assert st["per_layer_cells"][0] == st["per_layer_cells"][2] == st["sliding_cells"] == N + 1
    assert [len(layer) for layer in s.kept_positions()] == [2, 2]


def test_rollback_past_a_compaction_and_the_window(tiny_gemma):
    """Decoding 2 windows on a compacted sequence, then rolling back: the next token sees what it saw before."""
    ref = np_gemma(tiny_gemma)
    toks = prompt_tokens(N, 4)
    s = ReferenceSession(tiny_gemma)
    s.prefill(toks)
    s.apply_plan(Plan.from_lists([[np.arange(0, N, 3, dtype=np.int32)] * 2] * 2))
    snap = s.save_seq(0)
    for _ in range(2 * WINDOW):
        s.step({0: int(np.argmax(s.logits()))})
    s.rollback(0, 2 * WINDOW)
    assert s.stats()["kv_cells"] == snap.cells and s.seq(0).next_pos == N
    kv, _ = ref.prefill(toks)
    kept = np.arange(0, N, 3)
    entries = [[(np.array([kv[il][p][1][h] for p in kept]), np.array([kv[il][p][2][h] for p in kept]),
                 np.zeros(kept.size)) for h in range(2)] for il in (1, 3)]
    s.step({0: 42})
    _close(s.logits(), ref.step(42, N, kv, entries))


def test_reindexing_is_refused_in_one_line(tiny_gemma):
    s = ReferenceSession(tiny_gemma)
    s.prefill(prompt_tokens(N))
    with pytest.raises(KvcliError, match="re-indexing .* not supported for models with sliding-window layers"):
        s.apply_plan(Plan.keep_all(2, 2, N), reindex=True)
    assert not s.seq(0).compressed and s.stats()["kv_cells"] == N


def test_a_plan_for_every_model_layer_is_refused(tiny_gemma):
    s = ReferenceSession(tiny_gemma)
    s.prefill(prompt_tokens(N))
    with pytest.raises(KvcliError, match="plan is for 4 layers x 2 KV heads, the model has 2 x 2"):
        s.apply_plan(Plan.keep_all(4, 2, N))
