"""kvcli's per-cell metadata (native/src/kvcli_cells.h: a freed cell loses its slot bias at once) and the
byte moves of compaction run on host buffers without a model (kvcli_compact_rows, native/src/kvcli_moves.h)."""
from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest
from gguf import quants
from npref import entries_from_plan, np_model, prompt_tokens, random_plan

from kvcli.errors import KvcliError
from kvcli.native import cache
from kvcli.native.lib import I32P, lib, plan_view
from kvcli.native.session import CACHE_TYPES

N = 48


def test_truncated_cells_lose_their_bias_and_a_new_token_in_one_attends_normally(session_factory, tiny_model):
    """Truncating the last k of B compacted cells frees them: they carry no slot bias from then on (not only
    when a token reuses them), the next token lands in one of them and the logits equal a numpy pass over
    the entries left; removing the sequence leaves no biased cell and a new prompt decodes like a fresh
    context."""
    rng = np.random.default_rng(21)
    ref = np_model(tiny_model)
    s = session_factory(tiny_model, flash_attn=False, cache_type="f32")
    obs = s.prefill(prompt_tokens(N, 21), observe=("kv",)).with_kv_arrays()
    plan = random_plan(rng, ref.n_layer, ref.n_head_kv, N, ref.head_dim, obs.keys, obs.values)
    assert cache.cells_with_bias(s.ctx) == 0
    s.apply_plan(plan)
    B, k = plan.max_kept, 2
    assert B > k + 1 and np.any(plan.n_kept > B - k)  # the removed cells held entries of some (layer, head)
    assert cache.cells_with_bias(s.ctx) == B

    s.truncate(0, N - k)  # a plain compaction puts the B cells at positions N-B .. N-1
    assert cache.cells_with_bias(s.ctx) == B - k
    # kept entries are right-aligned in the B cells (Plan.first_slot): the last k cells held the latest k of each
    entries = [[tuple(x[:max(0, len(x) - k)] for x in e) for e in row]
               for row in entries_from_plan(plan, obs.keys, obs.values)]
    tok = 4321
    s.step({0: tok})
    want = ref.step(tok, N - k, entries)
    got = s.logits().astype(np.float64)
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    assert cache.cells_with_bias(s.ctx) == B - k  # the new token's cell carries none

    s.clear(0)
    assert cache.cells_with_bias(s.ctx) == 0 and not cache.is_compressed(s.ctx, 0)
    toks = prompt_tokens(20, 22)
    s.prefill(toks)
    fresh = session_factory(tiny_model, flash_attn=False, cache_type="f32")
    fresh.prefill(toks)
    assert np.abs(s.logits() - fresh.logits()).max() <= 1e-5
    assert cache.cells_with_bias(s.ctx) == 0


# ------------------------------------------------------------------ byte moves without a model

N_LAYER, N_HEAD_KV, HEAD_DIM, N_SLOTS, N_SRC = 3, 2, 64, 40, 57
ELEM = {"f32": 4, "f16": 2}
BLOCK = {"q8_0": (32, 34), "q4_0": (32, 18)}  # (values, bytes) per block


def _head_bytes(cache_type):
    if cache_type in ELEM:
        return HEAD_DIM * ELEM[cache_type]
    n, b = BLOCK[cache_type]
    return HEAD_DIM // n * b


def _compact_rows(plan, cache_type, src, slot_cells, src_pos, transposed, which, reindex, dst):
    view, _keep = plan_view(plan, HEAD_DIM)
    L = lib()
    return L.kvcli_compact_rows(ctypes.byref(view), CACHE_TYPES[cache_type], int(transposed), which, int(reindex),
                                N_SLOTS, slot_cells.ctypes.data_as(I32P), src_pos.ctypes.data_as(I32P), N_SRC,
                                src.ctypes.data, src.nbytes, dst.ctypes.data, dst.nbytes)


def _dequant(cache_type, raw):
    qt = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}[cache_type]
    return quants.dequantize(raw.reshape(1, -1), qt).reshape(-1)


def _expected_moves(plan, src_pos, reindex):
    """(layer, head, entry, slot, out) of every kept entry, written independently of the C++ code."""
    offs, B = plan.offsets(), plan.max_kept
    for l in range(plan.n_layer):
        for h in range(plan.n_head_kv):
            o, n = int(offs[l, h]), int(plan.n_kept[l, h])
            order = list(range(o, o + n))
            if reindex:
                order.sort(key=lambda e: src_pos[plan.slots[e]])  # sort is stable, as the C++ side
            for j, e in enumerate(order):
                yield l, h, e, int(plan.slots[e]), B - n + j   # right-aligned in both kinds (Plan.first_slot)


@pytest.mark.parametrize("cache_type,transposed", [
    ("f32", False), ("f16", False), ("q8_0", False), ("q4_0", False), ("f32", True), ("f16", True),
])
@pytest.mark.parametrize("reindex", [False, True])
def test_compact_rows_moves_the_planned_bytes(cache_type, transposed, reindex):
    rng = np.random.default_rng(7)
    keys = rng.standard_normal((N_LAYER, N_HEAD_KV, N_SLOTS, HEAD_DIM)).astype(np.float32)
    plan = random_plan(rng, N_LAYER, N_HEAD_KV, N_SLOTS, HEAD_DIM, keys, keys + 1)
    assert plan.replace_entry.size > 0
    B = plan.max_kept
    slot_cells = np.sort(rng.choice(N_SRC, N_SLOTS, replace=False)).astype(np.int32)  # gaps: other sequences
    src_pos = rng.permutation(1000)[:N_SLOTS].astype(np.int32)  # not in slot order: re-indexing reorders
    hb = _head_bytes(cache_type)
    src = rng.integers(0, 256, N_LAYER * N_SRC * N_HEAD_KV * hb, dtype=np.uint8)
    dst = np.full(N_LAYER * B * N_HEAD_KV * hb, 0xEE, np.uint8)
    which = 1
    assert _compact_rows(plan, cache_type, src, slot_cells, src_pos, transposed, which, reindex, dst) == B

    written = np.zeros((N_LAYER, N_HEAD_KV, B), bool)
    rep = {int(e): r for r, e in enumerate(plan.replace_entry)}
    # both as [layer, head, cell, bytes of the head's row]
    if transposed:  # element e = h*HEAD_DIM + d of cell c at e*n_cells + c
        el = ELEM[cache_type]
        rows_src = src.reshape(N_LAYER, N_HEAD_KV, HEAD_DIM, N_SRC, el).transpose(0, 1, 3, 2, 4).reshape(
            N_LAYER, N_HEAD_KV, N_SRC, hb)
        rows_dst = dst.reshape(N_LAYER, N_HEAD_KV, HEAD_DIM, B, el).transpose(0, 1, 3, 2, 4).reshape(
            N_LAYER, N_HEAD_KV, B, hb)
    else:
        rows_src = src.reshape(N_LAYER, N_SRC, N_HEAD_KV, hb).transpose(0, 2, 1, 3)
        rows_dst = dst.reshape(N_LAYER, B, N_HEAD_KV, hb).transpose(0, 2, 1, 3)
    for l, h, e, slot, out in _expected_moves(plan, src_pos, reindex):
        written[l, h, out] = True
        got = np.ascontiguousarray(rows_dst[l, h, out])
        if e not in rep:  # kept rows are byte copies of their slot's cell
            np.testing.assert_array_equal(got, rows_src[l, h, slot_cells[slot]])
            continue
        want = plan.replace_v[rep[e]]  # which = 1: V's replacement rows, in the cache type
        if cache_type == "f32":
            np.testing.assert_array_equal(got.view(np.float32), want)
        elif cache_type == "f16":
            np.testing.assert_array_equal(got.view(np.float16), want.astype(np.float16))
        else:
            tol = {"q8_0": 0.02, "q4_0": 0.25}[cache_type] * np.abs(want).max()
            assert np.abs(_dequant(cache_type, got) - want).max() <= tol
    # a cell no entry of a (layer, head) goes to is left as it was (the padding of that head)
    for l, h, out in zip(*np.nonzero(~written)):
        assert np.all(rows_dst[l, h, out] == 0xEE)
    assert (~written).any()  # the plan keeps fewer than B entries somewhere


def test_compact_rows_refuses_bad_buffers_and_cells():
    rng = np.random.default_rng(8)
    plan = random_plan(rng, N_LAYER, N_HEAD_KV, N_SLOTS, HEAD_DIM, merge=False)
    slot_cells = np.arange(N_SLOTS, dtype=np.int32)
    src_pos = np.arange(N_SLOTS, dtype=np.int32)
    src = np.zeros(N_LAYER * N_SRC * N_HEAD_KV * HEAD_DIM * 4, np.uint8)
    dst = np.zeros(N_LAYER * plan.max_kept * N_HEAD_KV * HEAD_DIM * 4, np.uint8)
    L = lib()

    def fails(msg, **kw):
        args = dict(plan=plan, cache_type="f32", src=src, slot_cells=slot_cells, src_pos=src_pos,
                    transposed=False, which=0, reindex=False, dst=dst) | kw
        assert _compact_rows(**args) < 0
        assert msg in L.last_error()

    fails("buffer sizes", dst=dst[:-1])
    fails("buffer sizes", src=src[:-4])
    bad = slot_cells.copy()
    bad[3] = N_SRC
    fails("outside the source", slot_cells=bad)
    fails("needs flash attention", cache_type="q8_0", transposed=True)
    plan.slots[0] = N_SLOTS
    fails("outside [0, 40)")
    with pytest.raises(KvcliError, match="outside"):
        L.check(_compact_rows(plan, "f32", src, slot_cells, src_pos, False, 0, False, dst), "kvcli_compact_rows")
