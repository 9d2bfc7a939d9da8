"""Chunked prefill (kvcli/drivers/chunked.py): when it turns on, how the context is sized, and the bad inputs."""
from __future__ import annotations

import numpy as np
import pytest

from kvcli.drivers.chunked import BOUNDED_ABOVE_BYTES, DEFAULT_CHUNK, MIN_CHUNK, _carry, chunk_sizes, plan_chunking
from kvcli.errors import KvcliError
from kvcli.planning.formats import Plan
from helpers import compression

CELL = 23_040         # K + V bytes of one f16 cell of the default model (SmolLM2-135M: 30 layers x 3 KV heads x 64)
CELL_8B = 131_072     # the same for a Llama-3-8B-shaped model (32 layers x 8 KV heads x 128)


def test_a_prompt_that_fits_is_read_in_one_go():
    # issue #19 changed the default: with a budget, a prompt longer than budget + DEFAULT_CHUNK is read in
    # bounded chunks (next test); --chunk 0 or a prompt within budget + DEFAULT_CHUNK reads in one go
    c = plan_chunking(3000, 256, 8192, compression("snapkv", 256), chunk=0, cell_bytes=CELL)
    assert c.chunk is None and c.n_ctx == 3328 and c.cap is None
    c = plan_chunking(256 + DEFAULT_CHUNK, 256, 8192, compression("snapkv", 256), cell_bytes=CELL)
    assert c.chunk is None and c.n_ctx == 1536
    c = plan_chunking(3000, 256, 8192, compression("full", None), cell_bytes=CELL)
    assert c.chunk is None and c.n_ctx == 3328


def test_a_budget_bounds_the_reading_by_default():
    """Bounded reading: the cache never holds more than budget + DEFAULT_CHUNK cells, whatever the length, and
    --max-cache stays the explicit bound (a prompt within it is read in one go)."""
    for n in (3000, 7000):
        c = plan_chunking(n, 256, 8192, compression("snapkv", 256), cell_bytes=CELL)
        assert c.chunk == DEFAULT_CHUNK and c.cap == 256 + DEFAULT_CHUNK and c.n_ctx == 1536
        assert "bounded" in c.why
    c = plan_chunking(3000, 256, 8192, compression("snapkv", 256), max_cache=4000, cell_bytes=CELL)
    assert c.chunk is None and c.n_ctx == 3328


def test_bounded_reading_waits_for_a_cache_worth_bounding():
    """A prompt longer than budget + DEFAULT_CHUNK whose full cache stays under BOUNDED_ABOVE_BYTES is read in
    one go (a short document keeps what one prefill keeps); the same length on a model with 5.7x wider cells is
    bounded."""
    n = 256 + DEFAULT_CHUNK + 1
    assert n * CELL <= BOUNDED_ABOVE_BYTES < n * CELL_8B
    assert plan_chunking(n, 256, 8192, compression("snapkv", 256), cell_bytes=CELL).chunk is None
    c = plan_chunking(n, 256, 8192, compression("snapkv", 256), cell_bytes=CELL_8B)
    assert c.chunk == DEFAULT_CHUNK and "bounded" in c.why
    just_over = BOUNDED_ABOVE_BYTES // CELL + 1
    assert plan_chunking(just_over, 256, 8192, compression("snapkv", 256), cell_bytes=CELL).chunk == DEFAULT_CHUNK
    assert plan_chunking(just_over - 1, 256, 8192, compression("snapkv", 256), cell_bytes=CELL).chunk is None


def test_the_threshold_moves_with_kvcli_bounded_above_mb(monkeypatch):
    monkeypatch.setenv("KVCLI_BOUNDED_ABOVE_MB", "0")
    c = plan_chunking(256 + DEFAULT_CHUNK + 1, 256, 8192, compression("snapkv", 256), cell_bytes=CELL)
    assert c.chunk == DEFAULT_CHUNK
    monkeypatch.setenv("KVCLI_BOUNDED_ABOVE_MB", "1000")
    assert plan_chunking(7000, 256, 8192, compression("snapkv", 256), cell_bytes=CELL).chunk is None
    for bad in ("lots", "-1", "nan"):
        monkeypatch.setenv("KVCLI_BOUNDED_ABOVE_MB", bad)
        with pytest.raises(KvcliError, match="KVCLI_BOUNDED_ABOVE_MB must be"):
            plan_chunking(7000, 256, 8192, compression("snapkv", 256), cell_bytes=CELL)


def test_a_prompt_longer_than_the_context_is_chunked_by_itself():
    c = plan_chunking(100_000, 256, 8192, compression("snapkv", 512), cell_bytes=CELL)
    assert c.chunk == DEFAULT_CHUNK and c.cap == 512 + DEFAULT_CHUNK
    assert c.n_ctx == 1792  # budget + chunk + answer, padded: the memory the cache really allocates


def test_max_cache_sets_the_chunk_and_the_context():
    c = plan_chunking(5000, 128, 8192, compression("h2o", 256), max_cache=1024, cell_bytes=CELL)
    assert (c.chunk, c.n_ctx, c.cap) == (1024 - 256 - 64, 1024, 1024 - 64)
    # an explicit chunk inside the bound is kept
    c = plan_chunking(5000, 128, 8192, compression("h2o", 256), chunk=512, max_cache=1024, cell_bytes=CELL)
    assert (c.chunk, c.n_ctx) == (512, 1024)


def test_explicit_chunk_on_a_prompt_that_fits_still_chunks():
    c = plan_chunking(3000, 256, 8192, compression("snapkv", 256), chunk=512, cell_bytes=CELL)
    assert c.chunk == 512 and c.cap == 768
    # one chunk: a plain prefill
    assert plan_chunking(400, 256, 8192, compression("snapkv", 256), chunk=512, cell_bytes=CELL).chunk is None


@pytest.mark.parametrize("args, message", [
    (dict(n_prompt=9000, policy="full", budget=None), "choose a compressing policy"),
    (dict(n_prompt=3000, policy="full", budget=None, chunk=512), "choose a compressing policy"),
    (dict(n_prompt=9000, policy="snapkv", budget=256, chunk=0), "drop --chunk 0"),
    (dict(n_prompt=9000, policy="snapkv", budget=256, chunk=-1), "--chunk must be >= 0"),
    (dict(n_prompt=9000, policy="snapkv", budget=256, chunk=8), f"at least {MIN_CHUNK}"),
    (dict(n_prompt=9000, policy="snapkv", budget=4000, chunk=5000), "do not fit"),
    (dict(n_prompt=9000, policy="snapkv", budget=900, max_cache=1000), "lower --budget"),
    (dict(n_prompt=9000, policy="snapkv", budget=256, max_cache=9000), "larger than the model's context"),
])
def test_bad_chunking_inputs_say_why(args, message):
    c = compression(args.pop("policy"), args.pop("budget"))
    with pytest.raises(KvcliError, match=message):
        plan_chunking(reserve=256, n_ctx_train=8192, compression=c, **args, cell_bytes=CELL)


@pytest.mark.parametrize("command", [["run", "Hi", "-n", "2"], ["chat", "--compress-once", "-n", "2"],
                                     ["compress", "-o", "OUT"]])
def test_a_document_to_read_in_chunks_without_a_budget_is_refused_in_one_line(tiny_1k, word_doc, run_kvcli, command,
                                                                             tmp_path):
    """A document longer than the context, a compressing policy and no --budget: the one message where the command
    resolves its compression (plan_chunking, which only ever sees a resolved one, has none of its own; issue #65)."""
    command = [str(tmp_path / "x.kvc") if a == "OUT" else a for a in command]
    r = run_kvcli(*command, "--doc", word_doc(3000), "--model", tiny_1k, "--policy", "snapkv", input="")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "policy 'snapkv' needs --budget N" in lines[0], r.stderr


def test_chunk_sizes_respect_the_cap_and_leave_a_whole_last_window():
    assert chunk_sizes(5000, cap=1280, cells=256, chunk=1024, min_tail=32) == 1024
    assert chunk_sizes(5000, cap=1280, cells=600, chunk=1024, min_tail=32) == 680   # a wide layer: shorter chunk
    assert chunk_sizes(1040, cap=1280, cells=256, chunk=1024, min_tail=32) == 1008  # the last chunk keeps 32
    assert chunk_sizes(500, cap=1280, cells=256, chunk=1024, min_tail=32) == 500


def test_carried_column_sums_follow_the_kept_entries_per_kv_head():
    # 1 layer, 4 query heads over 2 KV heads (group 2), 5 slots
    colsum = np.arange(20, dtype=np.float32).reshape(1, 4, 5)
    plan = Plan.from_lists([[np.array([0, 3, 4]), np.array([1])]])
    out = _carry(colsum, plan, group=2, reindexed=True)
    assert out.shape == (1, 4, 3)
    np.testing.assert_array_equal(out[0, 0], colsum[0, 0, [0, 3, 4]])
    np.testing.assert_array_equal(out[0, 1], colsum[0, 1, [0, 3, 4]])
    # right-aligned as a re-indexing compaction leaves them: the dead slots come first and carry nothing
    np.testing.assert_array_equal(out[0, 2], [0, 0, colsum[0, 2, 1]])
    np.testing.assert_array_equal(out[0, 3], [0, 0, colsum[0, 3, 1]])
    # without re-indexing (models with sliding-window layers) the same: every compaction right-aligns
    # (Plan.first_slot; the ragged layout stores no row for a layer's leading dead slots)
    out = _carry(colsum, plan, group=2, reindexed=False)
    np.testing.assert_array_equal(out[0, 0], colsum[0, 0, [0, 3, 4]])
    np.testing.assert_array_equal(out[0, 2], [0, 0, colsum[0, 2, 1]])
