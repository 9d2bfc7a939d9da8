"""Chunked reading of a model with sliding-window layers (kvcli/drivers/chunked.py): the global layers' cache is
compacted
after every chunk WITHOUT re-indexing (the entries keep their positions, as llama.cpp's window cache does), and
llama.cpp bounds the window cache. Checked on a tiny random gemma3 against the numpy pass of tests/native/npref.py,
which replays the reading chunk by chunk over exactly the entries each of the engine's plans kept."""
from __future__ import annotations

import numpy as np
import pytest
from npref import assert_gemma_logits_close as _close, np_gemma, prompt_tokens

from kvcli.drivers import chunked
from kvcli.planning.planner import resolve
from kvcli.errors import KvcliError

WINDOW = 16


def _session(session_factory, path, n_ctx=256):
    return session_factory(path, n_ctx=n_ctx, n_batch=32, flash_attn=False, cache_type="f32")


def _read(session, tokens, budget, chunk, scoring):
    cfg = resolve(session.model_path, "snapkv", budget, {"window": "8"})
    plans = {}
    report = chunked.read_in_chunks(session, tokens, cfg, chunk, scoring=scoring,
                                    on_step=lambda i, obs, plan: plans.__setitem__(i, plan))
    return report, plans


def _replay(ref, tokens, report, plans):
    """numpy's reading of `tokens` chunk by chunk: each token's global layers attend to the entries held then (the
    kept ones of every earlier plan, at their own positions, and the chunk's tokens so far); sliding layers to
    their window. Returns (kv, entries): the per-layer history and the global layers' held entries."""
    d, n_kv = ref.head_dim, ref.n_head_kv
    held = [[[] for _ in range(n_kv)] for _ in ref.global_layers]   # per slot: (K, V), None for a dead slot

    def entries():
        out = []
        for layer in held:
            row = []
            for slots in layer:
                live = [e for e in slots if e is not None]
                row.append((np.array([e[0] for e in live]).reshape(-1, d),
                            np.array([e[1] for e in live]).reshape(-1, d),
                            np.zeros(len(live))))
            out.append(row)
        return out

    kv = [[] for _ in range(ref.n_layer)]
    for i, st in enumerate(report.steps):
        for p in range(st.start, st.start + st.tokens):
            ref.step(tokens[p], p, kv, entries())
            for gi, il in enumerate(ref.global_layers):
                _, k, v = kv[il][-1]
                for h in range(n_kv):
                    held[gi][h].append((k[h], v[h]))
        if i in plans:
            plan = plans[i]
            for gi in range(len(held)):
                for h in range(n_kv):
                    assert len(held[gi][h]) == st.cells_before
                    kept = [held[gi][h][s] for s in plan.kept(gi, h)]
                    assert all(e is not None for e in kept)   # a plan never keeps a dead slot here
                    held[gi][h] = kept + [None] * (plan.max_kept - len(kept))   # slots 0..k-1, then dead ones
    return kv, entries()


@pytest.mark.parametrize("scoring", ["question", "chunk"])
def test_chunked_snapkv_matches_numpy(session_factory, tiny_gemma, scoring):
    """320 tokens in chunks of 64 at budget 24 in a context of 256 cells: a compaction of the global layers after
    every chunk, positions kept (past the context's size), the window cache bounded by llama.cpp (window + batch,
    rounded up to 256 cells); the next token's logits equal numpy's replay of the same reading."""
    n = 320
    toks = prompt_tokens(n, 7)
    s = _session(session_factory, tiny_gemma)
    report, plans = _read(s, toks, 24, 64, scoring)
    assert len(report.steps) >= 5 and len(plans) == len(report.steps)
    assert report.peak_cells <= 24 + 64 and all(st.cells_after == 24 for st in report.steps)
    assert s.seq(0).next_pos == n   # no re-indexing: decoding continues at the document's own next position
    st = s.stats()
    assert st["kv_cells"] == 24 and WINDOW <= st["sliding_cells"] <= 256
    ref = np_gemma(tiny_gemma)
    kv, ents = _replay(ref, toks, report, plans)
    s.step({0: 4242})
    _close(s.logits(), ref.step(4242, n, kv, ents))


def test_chunked_read_with_a_budget_above_the_document_is_the_one_go_cache(session_factory, tiny_gemma):
    """Nothing to compress: chunk by chunk (each scored by a probe prefilled and rolled back) the cache ends as the
    one-go read leaves it, and both decode alike."""
    toks = prompt_tokens(200, 8)
    s = _session(session_factory, tiny_gemma, n_ctx=512)
    report, plans = _read(s, toks, 256, 64, "question")
    assert len(report.steps) == 4 and not plans
    one = _session(session_factory, tiny_gemma, n_ctx=512)
    one.prefill(toks)
    assert s.stats()["kv_cells"] == one.stats()["kv_cells"] == 200
    for _ in range(4):
        assert np.abs(s.logits() - one.logits()).max() <= 1e-4
        t = int(np.argmax(one.logits()))
        s.step({0: t})
        one.step({0: t})


def test_a_document_past_the_trained_context_is_refused(session_factory, tmp_path):
    """Without re-indexing the positions grow with the document: past the model's context it is refused, in one
    line and before any prefill."""
    from kvcli.testing.tiny_gguf import write_tiny
    path = write_tiny(tmp_path / "g.gguf", "gemma3", n_layer=2, n_ctx_train=128, sliding_window=WINDOW, swa_pattern=2)
    s = session_factory(path, n_ctx=128)
    with pytest.raises(KvcliError, match=r"the prompt is 200 tokens, more than the model's context \(128 tokens\) "
                                         r"allows: a model with sliding-window layers \(gemma3\) is read in chunks "
                                         "without re-indexing its positions"):
        _read(s, prompt_tokens(200), 24, 48, "chunk")
    assert s.stats()["kv_cells"] == 0
