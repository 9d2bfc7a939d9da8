"""The ragged layout (native/src/kvcli_layout.cpp, issue #45): each cache layer stores the cells from its front on.

Every test runs the same plan under KVCLI_LAYOUT=ragged and =cells (llama.cpp's allocation, every layer as wide as
its widest) and holds the two to the same logits, observation and rows, while the ragged one allocates less."""
from __future__ import annotations

import numpy as np
import pytest

from kvcli.native import cache
from kvcli.planning.formats import Plan
from npref import prompt_tokens

N = 120


def _uneven_plan(n_layer: int, n_head_kv: int, widths: list[int], seed: int) -> Plan:
    """Layer l keeps widths[l] entries in every KV head (a layer-budget policy's shape), at random slots."""
    rng = np.random.default_rng(seed)
    kept = [[np.sort(rng.choice(N, widths[l], replace=False)).astype(np.int32) for _ in range(n_head_kv)]
            for l in range(n_layer)]
    return Plan.from_lists(kept)


def _compacted(session_factory, model, layout, monkeypatch, widths, **kw):
    monkeypatch.setenv("KVCLI_LAYOUT", layout)
    s = session_factory(model, flash_attn=True, cache_type=kw.pop("cache_type", "f16"), **kw)
    s.prefill(prompt_tokens(N, 3))
    s.apply_plan(_uneven_plan(s.info.n_layer, s.info.n_head_kv, widths, seed=4))
    return s


@pytest.mark.parametrize("cache_type", ["f16", "q8_0"])
def test_ragged_layout_holds_each_layer_and_decodes_as_the_cells_layout(session_factory, tiny_model_64, monkeypatch,
                                                                         cache_type):
    widths = [60, 12]
    cells = _compacted(session_factory, tiny_model_64, "cells", monkeypatch, widths, cache_type=cache_type)
    ragged = _compacted(session_factory, tiny_model_64, "ragged", monkeypatch, widths, cache_type=cache_type)
    assert cache.layout_fronts(cells.ctx) == [0, 0]
    assert cache.layout_fronts(ragged.ctx) == [0, 48]           # B = 60: layer 1's first 48 cells are dead
    rc, rr = (cache.stats(s.ctx, 0, s.info.n_layer_model, s.info.n_head_kv) for s in (cells, ragged))
    k_row = rc["k_bytes"] // (2 * 60)                          # one cell's K row in one layer
    assert rr["k_bytes"] == (60 + 12) * k_row and rr["v_bytes"] == rr["k_bytes"]
    assert ragged.stats()["kv_bytes_live"] == cells.stats()["kv_bytes_live"] == rr["k_bytes"] + rr["v_bytes"]
    # what the context allocated falls by layer 1's 48 rows of K and V
    assert cells.stats()["kv_bytes_allocated"] - ragged.stats()["kv_bytes_allocated"] == 48 * 2 * k_row
    keys_c, values_c = cache.read_kv(cells.ctx, 0, cells.info)
    keys_r, values_r = cache.read_kv(ragged.ctx, 0, ragged.info)
    np.testing.assert_array_equal(keys_r, keys_c)              # dead rows read as the zeros they were
    np.testing.assert_array_equal(values_r, values_c)
    for t in (11, 22, 33):
        for s in (cells, ragged):
            s.step({0: t})
        np.testing.assert_array_equal(ragged.logits(), cells.logits())


def test_observation_state_and_removal_under_the_ragged_layout(session_factory, tiny_model, monkeypatch):
    widths = [40, 9, 25]
    cells = _compacted(session_factory, tiny_model, "cells", monkeypatch, widths)
    ragged = _compacted(session_factory, tiny_model, "ragged", monkeypatch, widths)
    assert cache.layout_fronts(ragged.ctx) == [0, 31, 15]
    # observing more tokens over the trimmed layers: the same sums at the same cells
    more = prompt_tokens(12, 8)
    oc = cells.prefill(more, observe=("window", "colsum"), window=4)
    orr = ragged.prefill(more, observe=("window", "colsum"), window=4)
    # to 1e-4 (logits below to 2e-3): rounding, traced (#62). Layer 1's rows (front 31: n_kv 225, not 256) take other
    # ggml CPU kernels than the cells layout's: llamafile's tinyBLAS needs m % 4 == 0 and k % 16 == 0 (AVX-512;
    # sgemm.cpp, tinyBLAS::matmul), so KQ (m = n_kv) and P.V (k = n_kv) fall back to ggml_vec_dot_f16/_f32, and the
    # softmax's 16-lane chunks and its scalar expf tail (vec.cpp, ggml_vec_soft_max_f32) start 31 cells later. Its
    # probabilities differ by 3e-7 and its output by f32 ulps; layer 2's K/V rows of the 12 new tokens are that output
    # rounded to f16, and on a 2-core AMD EPYC with AVX-512 (2026-12-03) 3 of their elements rounded to the
    # neighbouring f16 (K -2.0762 vs -2.0781: one ulp), so layer 2's sums differ by up to 5.6e-5 (11 of 208) and the
    # step that attends those rows by 1.1e-3. Whether an f16 rounding flips is chance: within 1e-6 on the machines
    # before. A misplaced cell differs by a probability itself (1e-2 and more). Fronts that are multiples of 16 keep
    # every kernel and lane: bit for bit (the test below). Decoding (one row: flash attention, which skips the -inf
    # cells one at a time) stays bit for bit too (the test above).
    np.testing.assert_allclose(orr.colsum, oc.colsum, atol=1e-4)
    np.testing.assert_allclose(orr.window_sums, oc.window_sums, atol=1e-4)
    # a saved state restores into a fresh context and is trimmed again there
    snap = ragged.save_seq(0)
    assert cache.layout_fronts(ragged.ctx) == [0, 31, 15]
    monkeypatch.setenv("KVCLI_LAYOUT", "ragged")
    t = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    t.restore_seq(snap, 0)
    assert cache.layout_fronts(t.ctx) == [0, 31, 15]
    for s in (cells, t):
        s.step({0: 77})
    np.testing.assert_allclose(t.logits(), cells.logits(), atol=2e-3)   # the rows observed above differ by rounding
    # removing the sequence gives every layer its rows back before a new prompt can use those cells
    t.clear(0)
    assert cache.layout_fronts(t.ctx) == [0, 0, 0]
    toks = prompt_tokens(30, 12)
    t.prefill(toks)
    fresh = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    fresh.prefill(toks)
    np.testing.assert_allclose(t.logits(), fresh.logits(), atol=1e-5)


def test_observation_is_bit_identical_when_the_fronts_are_multiples_of_16(session_factory, tiny_model, monkeypatch):
    # the rounding the test above allows comes only from n_kv and the front's offset within ggml's 16-wide kernels:
    # with fronts of 32 and 16 (n_kv 224, 240) the few-rows path runs the same kernels on the same lanes as the cells
    # layout, whose leading dead cells add exact zeros, so a cell placed one off would show here at any size
    widths = [40, 8, 24]
    cells = _compacted(session_factory, tiny_model, "cells", monkeypatch, widths)
    ragged = _compacted(session_factory, tiny_model, "ragged", monkeypatch, widths)
    assert cache.layout_fronts(ragged.ctx) == [0, 32, 16]
    more = prompt_tokens(12, 8)
    oc = cells.prefill(more, observe=("window", "colsum"), window=4)
    orr = ragged.prefill(more, observe=("window", "colsum"), window=4)
    np.testing.assert_array_equal(orr.colsum, oc.colsum)
    np.testing.assert_array_equal(orr.window_sums, oc.window_sums)
    for s in (cells, ragged):
        s.step({0: 77})
    np.testing.assert_array_equal(ragged.logits(), cells.logits())


def test_a_bad_layout_value_is_a_clear_error(session_factory, tiny_model, monkeypatch):
    from kvcli.errors import KvcliError
    monkeypatch.setenv("KVCLI_LAYOUT", "squashed")
    with pytest.raises(KvcliError, match="KVCLI_LAYOUT must be ragged or cells"):
        session_factory(tiny_model, flash_attn=True, cache_type="f16")
    monkeypatch.setenv("KVCLI_LAYOUT", "cells")
    s = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    s.prefill(prompt_tokens(N, 3))
    monkeypatch.setenv("KVCLI_LAYOUT", "squashed")        # changed after the session opened: the compaction refuses
    with pytest.raises(KvcliError, match="KVCLI_LAYOUT must be ragged or cells"):
        s.apply_plan(_uneven_plan(3, 2, [20, 10, 5], seed=1))
    assert not cache.is_compressed(s.ctx, 0)


def _two_sequences(session_factory, model, layout, monkeypatch, widths0, widths1, cache_type="f16"):
    monkeypatch.setenv("KVCLI_LAYOUT", layout)
    s = session_factory(model, flash_attn=True, cache_type=cache_type, n_seq=2)
    for seq, widths, seed in ((0, widths0, 4), (1, widths1, 5)):
        s.prefill(prompt_tokens(N, 3 + seq), seq=seq)
        s.apply_plan(_uneven_plan(s.info.n_layer, s.info.n_head_kv, widths, seed=seed), seq=seq)
    return s


def test_packing_trims_every_sequence_of_a_shared_cache(session_factory, tiny_model, monkeypatch):
    # kvcli batch: two compressed sequences in one cache. Before packing only the block at the start of the cache is
    # trimmed; packing puts the cells dead in more layers first (each sequence keeping its order)
    w0, w1 = [40, 9, 25], [30, 20, 5]
    cells = _two_sequences(session_factory, tiny_model, "cells", monkeypatch, w0, w1)
    ragged = _two_sequences(session_factory, tiny_model, "ragged", monkeypatch, w0, w1)
    assert cache.layout_fronts(ragged.ctx) == [0, 31, 15]     # sequence 0's block only
    monkeypatch.setenv("KVCLI_LAYOUT", "cells")
    assert cells.pack_cells() == 0 and cache.layout_fronts(cells.ctx) == [0, 0, 0]   # the cells layout: untouched
    monkeypatch.setenv("KVCLI_LAYOUT", "ragged")
    before = {q: cache.read_kv(ragged.ctx, q, ragged.info) for q in (0, 1)}
    assert ragged.pack_cells() > 0
    # dead in layers 1 and 2: 15 + 10 cells; then dead in layer 1 only (sequence 0's 16, lower cells first), then
    # in layer 2 only (sequence 1's 15)
    assert cache.layout_fronts(ragged.ctx) == [0, 25 + 16, 25]
    assert ragged.pack_cells() == 0                            # packed already
    for q in (0, 1):
        keys, values = cache.read_kv(ragged.ctx, q, ragged.info)
        np.testing.assert_array_equal(keys, before[q][0])     # each sequence's rows, in its own order
        np.testing.assert_array_equal(values, before[q][1])
    k_row = cache.stats(cells.ctx, 0, cells.info.n_layer_model, cells.info.n_head_kv)["k_bytes"] // (3 * 40)
    held = (70 * 3 - 41 - 25) * 2 * k_row                       # 70 cells in 3 layers, less the two fronts
    assert cells.stats()["kv_bytes_allocated"] - ragged.stats()["kv_bytes_allocated"] == (41 + 25) * 2 * k_row
    live = sum(w0) * 2 * k_row + sum(w1) * 2 * k_row
    assert held - live == (40 - 25) * 2 * k_row                # layer 2: 40 dead slots, 25 of them in the prefix
    for t in (11, 22, 33):                                     # both decode together as under the cells layout
        for s in (cells, ragged):
            s.step({0: t, 1: t + 1})
        for q in (0, 1):
            np.testing.assert_allclose(ragged.logits(q), cells.logits(q), atol=1e-5)
    # a packed sequence saves and restores (into a fresh cache it is trimmed by its own profile)
    snap = ragged.save_seq(1)
    monkeypatch.setenv("KVCLI_LAYOUT", "ragged")
    t = session_factory(tiny_model, flash_attn=True, cache_type="f16")
    t.restore_seq(snap, 0)
    assert cache.layout_fronts(t.ctx) == [0, 10, 25]
    t.step({0: 44})
    cells.step({1: 44})
    np.testing.assert_allclose(t.logits(0), cells.logits(1), atol=1e-5)
    # a sequence leaves: the layers give back the rows of its cells; packing again trims by what is left
    ragged.clear(0)
    ragged.pack_cells()
    assert cache.layout_fronts(ragged.ctx) == [0, 10, 25]
    ragged.step({1: 44})
    np.testing.assert_allclose(ragged.logits(1), cells.logits(1), atol=1e-5)


def test_packing_moves_quantised_rows_whole(session_factory, tiny_model_64, monkeypatch):
    # q8_0 rows (whole blocks per KV head) move as bytes: the packed cache decodes as the cells layout does
    w0, w1 = [40, 9], [30, 20]
    cells = _two_sequences(session_factory, tiny_model_64, "cells", monkeypatch, w0, w1, "q8_0")
    ragged = _two_sequences(session_factory, tiny_model_64, "ragged", monkeypatch, w0, w1, "q8_0")
    assert cache.layout_fronts(ragged.ctx) == [0, 31]
    assert ragged.pack_cells() > 0
    assert cache.layout_fronts(ragged.ctx) == [0, 31 + 10]    # layer 1: both sequences' dead slots, one prefix
    assert sum(ragged.stats(q)["kv_bytes_live"] for q in (0, 1)) == \
        sum(cache.stats(ragged.ctx, q, ragged.info.n_layer_model, ragged.info.n_head_kv)["k_bytes"] * 2 for q in (0, 1))
    for t in (5, 6):
        for s in (cells, ragged):
            s.step({0: t, 1: t})
        for q in (0, 1):
            np.testing.assert_allclose(ragged.logits(q), cells.logits(q), atol=1e-5)
