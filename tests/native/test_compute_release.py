"""kvcli_release_compute (issue #62): the compute buffer's pages given back after a prefill are scratch, so
nothing a later graph computes changes: a session that gives them back after every prefill (the default) and
between decoded tokens decodes the same logits, bit for bit, as one that keeps them, including a graph llama.cpp
reuses across the release."""
from __future__ import annotations

import numpy as np
import pytest

import kvcli.native.cache as cache


def _run(session_factory, model, release_between_steps: bool):
    s = session_factory(model, n_ctx=1024, n_seq=2)
    rng = np.random.default_rng(3)
    doc = [int(t) for t in rng.integers(10, 200, 700)]
    s.prefill(doc, seq=0, observe=("window",), window=8)   # several ubatches and an observed one
    out = [s.logits(0).copy()]
    s.prefill([11, 12, 13, 14, 15], seq=1)
    out.append(s.logits(1).copy())
    tok = int(np.argmax(out[0]))
    for _ in range(4):   # one-row graphs of one shape: llama.cpp reuses the graph from the second step on
        s.step({0: tok})
        if release_between_steps:
            assert cache.release_compute(s.ctx) > 0
        out.append(s.logits(0).copy())
        tok = int(np.argmax(out[-1]))
    return out


def test_released_pages_change_no_logits(session_factory, tiny_model, monkeypatch):
    released = _run(session_factory, tiny_model, release_between_steps=True)
    monkeypatch.setattr(cache, "release_compute", lambda ctx: 0)   # the pages kept, as before the release existed
    kept = _run(session_factory, tiny_model, release_between_steps=False)
    assert len(released) == len(kept)
    for a, b in zip(released, kept):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("flash_attn", [True, False])
def test_a_prefill_gives_its_compute_pages_back(session_factory, tiny_model, monkeypatch, flash_attn):
    calls = []
    real = cache.release_compute
    monkeypatch.setattr(cache, "release_compute", lambda ctx: calls.append(real(ctx)) or calls[-1])
    s = session_factory(tiny_model, n_ctx=1024, flash_attn=flash_attn)
    s.prefill(list(range(10, 400)), seq=0)    # two ubatches of the session's 256
    assert len(calls) == 2 and min(calls) > 0  # after each, the context's host compute buffer, whole pages of it
    s.step({0: 5})
    assert len(calls) == 2                     # a decoded token keeps its few pages


@pytest.mark.parametrize("rows", [6, 100])
def test_a_few_rows_question_takes_the_grouped_window_observation(session_factory, tiny_model, rows):
    """A CPU cache's observed question of few rows has its window sums added into the host accumulators by the graph
    and its observation built beside its attention, a group of KV heads at a time (kvcli_window_defer): the last
    graph names the groups' nodes. (The cache's K is a view at graph build; the path was once never taken for it.)"""
    s = session_factory(tiny_model, n_ctx=1024)
    s.prefill(list(range(10, 300)), seq=0)
    s.prefill(list(range(20, 20 + rows)), seq=0, observe=("window",), window=rows)
    deferred = cache.last_graph_count(s.ctx, "kvcli_obs_winsum-0-h")
    every_head = cache.last_graph_count(s.ctx, "kvcli_obs_winsum-0") - deferred
    if rows == 6:   # every row of a few-rows ubatch observed: deferred, per group of KV heads (2 here)
        assert deferred > 0 and every_head == 0
        assert cache.last_graph_count(s.ctx, "kvcli_obs_winsum-0-h2") > 0   # the second group's (query heads 2, 3)
        assert cache.last_graph_count(s.ctx, "kvcli_rows_kqv-0-g") == 2
    else:           # more rows than the few-rows path takes: observed apart from the attention, every head at once
        assert deferred == 0 and every_head > 0


@pytest.mark.parametrize("observed", [True, False])
def test_every_layer_of_a_deep_model_attends_a_few_rows_question_by_groups(session_factory, tmp_path, observed):
    """qwen2.5-0.5b's shape of heads and layers (24 layers, 14 query heads over 2 KV heads): every layer's few-rows
    attention is built a KV-head group at a time. The room check once counted the graph's own arrays as the first
    layers' tensors and refused them groups (their [n_kv, rows, 14] products doubled a 16k question's scratch)."""
    from kvcli.testing.tiny_gguf import write_tiny_llama
    n_layer = 24
    model = write_tiny_llama(tmp_path / "deep.gguf", n_layer=n_layer, n_head=14, n_head_kv=2, head_dim=16, seed=4)
    s = session_factory(model, n_ctx=1024)
    s.prefill(list(range(10, 300)), seq=0)
    s.prefill(list(range(20, 28)), seq=0, observe=("window",) if observed else (), window=8 if observed else 0)
    assert [cache.last_graph_count(s.ctx, f"kvcli_rows_kqv-{il}-g") for il in range(n_layer)] == [2] * n_layer


def test_few_rows_calls_are_cut_to_the_scratch_cap():
    from kvcli.native.session import FEW_ROWS_MAX, _batch_cuts, _few_rows_cuts, few_rows_cap
    assert few_rows_cap(16_000, 14) == 18                        # qwen2.5-0.5b over a 16k document: 16 MiB / 0.9 MB
    assert few_rows_cap(300, 4) == FEW_ROWS_MAX and few_rows_cap(10**7, 64) == 8
    assert _few_rows_cuts(_batch_cuts(40, 256, 40), 9) == [8, 16, 24, 32, 40]
    # a read's 256-row calls take flash attention (no probabilities made): kept; its few-rows tail and window cut
    assert _few_rows_cuts(_batch_cuts(300, 256, 32), 9) == [256, 262, 268, 276, 284, 292, 300]
    assert _few_rows_cuts(_batch_cuts(100, 256, 100), 9) == [100]   # above FEW_ROWS_MAX: flash attention's


def test_a_question_cut_into_few_rows_calls_observes_and_answers_as_one(session_factory, tiny_model, monkeypatch):
    """A question cut into calls of at most 8 rows (FEW_ROWS_SCRATCH lowered) sums the same window probabilities and
    ends on the same logits as the question in one call, to float rounding (the rows' sums are added in another
    order)."""
    import kvcli.native.session as ns
    calls = []
    real = ns.NativeSession._decode
    monkeypatch.setattr(ns.NativeSession, "_decode", lambda self, e: calls.append(len(e)) or real(self, e))
    rng = np.random.default_rng(5)
    doc = [int(t) for t in rng.integers(10, 200, 290)]
    question = [int(t) for t in rng.integers(10, 200, 30)]
    out = []
    for scratch in (1 << 40, 1):
        monkeypatch.setattr(ns, "FEW_ROWS_SCRATCH", scratch)
        s = session_factory(tiny_model, n_ctx=1024)
        s.prefill(doc, seq=0)
        calls.clear()
        obs = s.prefill(question, seq=0, observe=("window",), window=30)
        out.append((list(calls), obs.window_sums.copy(), s.logits(0)))
    (whole, sums_a, logits_a), (cut, sums_b, logits_b) = out
    assert whole == [30] and len(cut) == 4 and max(cut) == 8 and sum(cut) == 30
    np.testing.assert_allclose(sums_b, sums_a, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits_b, logits_a, rtol=1e-4, atol=1e-4)


def test_a_sibling_session_prefills_questions_as_its_parent(session_factory, tiny_model):
    """A sibling (kvcli batch reads documents in one) takes every model-wide setting of its parent, the few-rows
    cut's included (a name missing from its copied list failed every batch question with an AttributeError)."""
    rng = np.random.default_rng(7)
    doc = [int(t) for t in rng.integers(10, 200, 200)]
    question = [int(t) for t in rng.integers(10, 200, 20)]
    parent = session_factory(tiny_model, n_ctx=512)
    sib = parent.sibling(512)
    try:
        shared = {k for k in vars(parent) if k not in ("ctx", "_batch", "seqs", "_owns_model", "_ctx_opts")}
        assert shared <= set(vars(sib))
        for s in (parent, sib):
            s.prefill(doc, seq=0)
            s.prefill(question, seq=0, observe=("window",), window=20)
        np.testing.assert_allclose(sib.logits(0), parent.logits(0), rtol=1e-4, atol=1e-4)
    finally:
        sib.close()
