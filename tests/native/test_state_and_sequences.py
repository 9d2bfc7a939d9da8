"""Compressed sequence states (get -> set -> continue, truncated/foreign states; the .kvc file around them is
tests/test_kvc.py's), refused operations on a compressed sequence, and several sequences decoded together in
one batch."""
from __future__ import annotations

import numpy as np
import pytest
from npref import prompt_tokens, random_plan

from kvcli.errors import KvcliError
from kvcli.native import cache, load_llama_cpp
from kvcli.native.lib import lib

N = 40


def _compressed(session_factory, model, seed=0, **kw):
    s = session_factory(model, flash_attn=True, cache_type="f16", **kw)
    s.prefill(prompt_tokens(N, seed))
    plan = random_plan(np.random.default_rng(seed), s.info.n_layer, s.info.n_head_kv, N, s.info.head_dim)
    s.apply_plan(plan)
    return s, plan


def _continue(s, first, n, seq=0):
    s.step({seq: first})
    out = []
    for _ in range(n):
        t = int(np.argmax(s.logits(seq)))
        out.append(t)
        s.step({seq: t})
    return out, s.logits(seq)


def _into(s, meta, seq=0):
    """Tell the session about a sequence loaded from a file (its own bookkeeping)."""
    st = s.seq(seq)
    st.next_pos, st.cells = meta["next_pos"], meta["cells"]


def test_save_load_continue_equals_in_memory(session_factory, tiny_model):
    s, plan = _compressed(session_factory, tiny_model, seed=1)
    cache.set_header(s.ctx, 0, "random", 20, N)
    state = cache.get_state(s.ctx, 0)
    assert len(state) > 0
    before = cache.stats(s.ctx, 0, s.info.n_layer, s.info.n_head_kv)
    want, want_logits = _continue(s, 17, 6)

    t = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    cache.set_state(t.ctx, 0, state)
    _into(t, {"next_pos": N, "cells": plan.max_kept})
    assert cache.is_compressed(t.ctx, 0)
    hdr = cache.get_header(t.ctx, 0)
    assert hdr["policy"] == "random" and hdr["budget"] == 20 and hdr["original_tokens"] == N
    assert hdr["kvcli_version"] == lib().kvcli_version().decode()
    assert cache.stats(t.ctx, 0, t.info.n_layer, t.info.n_head_kv) == before
    got, got_logits = _continue(t, 17, 6)
    assert got == want
    assert np.abs(got_logits - want_logits).max() <= 1e-5


def test_state_loads_into_another_sequence_of_a_busy_context(session_factory, tiny_model):
    s, plan = _compressed(session_factory, tiny_model, seed=2)
    state = cache.get_state(s.ctx, 0)
    want, _ = _continue(s, 3, 5)
    t = session_factory(tiny_model, flash_attn=True, cache_type="f16", n_seq=2)
    t.prefill(prompt_tokens(25, 99), seq=0)       # seq 0 busy: the loaded cells land elsewhere
    cache.set_state(t.ctx, 1, state)
    _into(t, {"next_pos": N, "cells": plan.max_kept}, seq=1)
    got, _ = _continue(t, 3, 5, seq=1)
    assert got == want


def test_truncated_and_foreign_states_give_clear_errors(session_factory, tiny_model):
    s, plan = _compressed(session_factory, tiny_model, seed=3)
    raw = cache.get_state(s.ctx, 0)
    t = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    with pytest.raises(KvcliError, match="cannot load the cache state"):
        cache.set_state(t.ctx, 0, raw[: len(raw) // 2])
    # a payload that is not a kvcli state: the library says so
    with pytest.raises(KvcliError, match="not a kvcli cache state"):
        cache.set_state(t.ctx, 0, b"\xd8\x3c\x14\xaf" + bytes(4) + bytes(64))
    # the cache is untouched by the failed loads
    assert cache.stats(t.ctx, -1, t.info.n_layer, t.info.n_head_kv)["n_cells"] == 0


def test_state_of_another_model_or_format_is_refused(session_factory, tiny_model, other_tiny_model):
    s, plan = _compressed(session_factory, tiny_model, seed=4)
    payload = cache.get_state(s.ctx, 0)
    o = session_factory(other_tiny_model, flash_attn=True, cache_type="f16")
    with pytest.raises(KvcliError, match="another model"):
        cache.set_state(o.ctx, 0, payload)
    assert not cache.is_compressed(o.ctx, 0)

    # a kvcli state format this build does not read (the field after the kvcli magic)
    i = payload.index(b"KVCL")
    forged = payload[: i + 4] + (99).to_bytes(4, "little") + payload[i + 8:]
    t = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    with pytest.raises(KvcliError, match="state format 99"):
        cache.set_state(t.ctx, 0, forged)
    # another cache type than the one it was saved with: llama.cpp refuses, kvcli says why
    q = session_factory(tiny_model, flash_attn=True, cache_type="f32")
    with pytest.raises(KvcliError, match="cannot load the cache state"):
        cache.set_state(q.ctx, 0, payload)


def test_shifting_a_compressed_sequence_is_refused(session_factory, tiny_model):
    s, _ = _compressed(session_factory, tiny_model, seed=5)
    pos = cache.seq_positions(s.ctx, 0).copy()
    with pytest.raises(KvcliError, match="compressed"):
        cache.shift_positions(s.ctx, 0, 0, -1, -4)
    # the raw llama.cpp call (context shift) is refused inside the library too: nothing moves
    L = load_llama_cpp()
    L.llama_memory_seq_add(L.llama_get_memory(s.ctx), 0, 0, -1, -4)
    L.llama_memory_seq_div(L.llama_get_memory(s.ctx), 0, 0, -1, 2)
    assert "seq_div refused" in lib().last_error()
    np.testing.assert_array_equal(cache.seq_positions(s.ctx, 0), pos)
    # an uncompressed sequence still shifts
    u = session_factory(tiny_model)
    u.prefill(prompt_tokens(10))
    cache.shift_positions(u.ctx, 0, 0, -1, 5)
    np.testing.assert_array_equal(cache.seq_positions(u.ctx, 0), np.arange(5, 15))


def test_refusals_while_observing_or_sharing_cells(session_factory, tiny_model):
    from kvcli.planning.formats import Plan
    s = session_factory(tiny_model, n_seq=2)
    s.prefill(prompt_tokens(N))
    keep = Plan.keep_all(s.info.n_layer, s.info.n_head_kv, N)
    cache.observe_begin(s.ctx, 0, ("colsum",), 0)
    with pytest.raises(KvcliError, match="observation is still armed"):
        cache.apply_plan(s.ctx, 0, keep, s.info.head_dim)
    cache.observe_end(s.ctx)
    L = load_llama_cpp()
    L.llama_memory_seq_cp(L.llama_get_memory(s.ctx), 0, 1, -1, -1)
    with pytest.raises(KvcliError, match="shares cells"):
        cache.apply_plan(s.ctx, 0, keep, s.info.head_dim)


def test_seq_cp_of_a_compressed_sequence_shares_its_bias(session_factory, tiny_model):
    s, plan = _compressed(session_factory, tiny_model, seed=6, n_seq=2)
    L = load_llama_cpp()
    L.llama_memory_seq_cp(L.llama_get_memory(s.ctx), 0, 1, -1, -1)
    assert cache.is_compressed(s.ctx, 1)
    st1 = s.seq(1)
    st1.next_pos, st1.cells = N, plan.max_kept
    s.step({0: 21, 1: 21})
    np.testing.assert_allclose(s.logits(0), s.logits(1), atol=1e-5)


# f16 + flash attention: llama.cpp's CPU kernel accumulates V in f16 in cell order, and a new token
# that lands in a freed cell ahead of older ones changes that order (stock llama.cpp does the same
# with a seq_rm hole: ~1e-2 on logits of scale 10), so that case checks tokens and 5e-2 only.
@pytest.mark.parametrize("flash_attn,cache_type,tol", [(False, "f32", 1e-4), (True, "f16", 5e-2)])
def test_two_sequences_one_compressed_decode_together_like_alone(session_factory, tiny_model, flash_attn,
                                                                 cache_type, tol):
    """seq 0 compressed, seq 1 not, decoded in one batch: the same greedy tokens as each alone."""
    kw = dict(flash_attn=flash_attn, cache_type=cache_type)
    a_toks, b_toks = prompt_tokens(N, 10), prompt_tokens(30, 11)
    plan = random_plan(np.random.default_rng(10), 3, 2, N, 16, merge=False)

    alone_a = session_factory(tiny_model, **kw)
    alone_a.prefill(a_toks)
    alone_a.apply_plan(plan)
    alone_b = session_factory(tiny_model, **kw)
    alone_b.prefill(b_toks)

    both = session_factory(tiny_model, n_seq=2, **kw)
    both.prefill(a_toks, seq=0)
    both.prefill(b_toks, seq=1)
    both.apply_plan(plan, seq=0)   # seq 0's freed cells become holes between the two

    # the batch's first tokens: llama.cpp keeps only the last llama_decode's logits, and seq 1's
    # prefill came after seq 0's, so both start from the tokens the lone runs chose
    ja, jb = [int(np.argmax(alone_a.logits()))], [int(np.argmax(alone_b.logits()))]
    ta, tb = list(ja), list(jb)
    both.step({0: ta[0], 1: tb[0]})
    alone_a.step({0: ja[0]})
    alone_b.step({0: jb[0]})
    for _ in range(7):
        na, nb = int(np.argmax(alone_a.logits())), int(np.argmax(alone_b.logits()))
        ja.append(na)
        jb.append(nb)
        alone_a.step({0: na})
        alone_b.step({0: nb})
        xa, xb = int(np.argmax(both.logits(0))), int(np.argmax(both.logits(1)))
        ta.append(xa)
        tb.append(xb)
        both.step({0: xa, 1: xb})
    assert ta == ja and tb == jb
    st = cache.stats(both.ctx, -1, 3, 2)
    assert st["n_cells"] == plan.max_kept + 8 + 30 + 8
    assert np.abs(both.logits(0) - alone_a.logits()).max() <= tol
    assert np.abs(both.logits(1) - alone_b.logits()).max() <= tol
