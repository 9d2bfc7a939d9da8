"""The `query` observation (expected_attention's Q rows, issue #32): both engines give the same rows of the same
positions on a float32 tiny model (f32 cache, no flash attention), alone or beside window sums; a window longer than
the prompt gives every query; the RoPE both engines describe (Observation.rope) is llama.cpp's, checked on the native
engine's own Q and K rows (llama: adjacent pairs, qwen2: NEOX halves); phi3, whose Q llama.cpp scales by 1/sqrt(d)
before attention (kq_scale 1), gives the model's own rows in both engines (the native observation undoes the scale)."""
from __future__ import annotations

import numpy as np
import pytest

from kvcli.native.session import NativeSession
from kvcli.reference.session import ReferenceSession
from kvcli.testing.tiny_gguf import write_tiny

TOKENS = [int(t) for t in np.random.default_rng(1).integers(5, 200, size=100)]


@pytest.fixture(scope="module", params=["llama", "qwen2", "phi3"])
def tiny(request, tmp_path_factory):
    return request.param, write_tiny(tmp_path_factory.mktemp("q") / f"{request.param}.gguf", request.param,
                                     n_layer=2, n_head=4, n_head_kv=2, head_dim=16)


def observe(session_cls, path, observe, window):
    kw = {"cache_type": "f32", "flash_attn": False} if session_cls is NativeSession else {}
    s = session_cls(path, n_ctx=256, **kw)
    try:
        return s.prefill(TOKENS, observe=observe, window=window).with_kv_arrays()
    finally:
        s.close()


def test_engines_give_the_same_rows(tiny):
    arch, path = tiny
    for kinds, window, rows in ((("query",), 10, 10), (("query", "window"), (4, 12), 12), (("query",), 500, 100)):
        nat, ref = (observe(S, path, kinds, window) for S in (NativeSession, ReferenceSession))
        for o in (nat, ref):
            assert o.queries.shape == (2, 4, rows, 16) and o.query_positions.tolist() == list(range(100 - rows, 100))
            assert o.rope.neox == (arch != "llama")
        np.testing.assert_allclose(nat.queries, ref.queries, atol=1e-4 * np.abs(ref.queries).max())
        if "window" in kinds:
            assert nat.windows == ref.windows == (4, 12)
            assert nat.restrict(("query",), 4).queries.shape[2] == 4


def test_rope_pairing_matches_llama_cpp(tiny):
    """q.k of a query at position p and a key at position j equals the un-rotated query turned by (p - j) dotted with
    the un-rotated key: wrong pairs or frequencies break it."""
    arch, path = tiny
    o = observe(NativeSession, path, ("query", "kv"), 10)
    k = o.keys[1]
    qpre, kpre = o.rope.unrotate(o.queries[1], o.query_positions), o.rope.unrotate(k, o.positions)
    for head, row, j in ((0, 0, 3), (3, 9, 60), (2, 4, 94)):
        ang = (o.query_positions[row] - j) * o.rope.freqs
        rel = o.rope.turn(qpre[head, row], np.cos(ang), np.sin(ang)) @ kpre[head // 2, j]
        assert rel == pytest.approx(float(o.queries[1, head, row] @ k[head // 2, j]), rel=1e-4, abs=1e-4)
