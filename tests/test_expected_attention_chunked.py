"""expected_attention under bounded (chunked) reading (issue #32: it works wherever a policy works): after every chunk
the statistics of that chunk's last `window` queries (the most recent ones, as the last `window` prompt queries are
in one prefill) and the rotation of the positions after the chunk score every held entry (the kept ones and the
chunk's); both engines plan identically at every step; the cache never holds more than budget + chunk; a prompt read
in one chunk gives the one-prefill plan; bounded reading does not turn on by itself for it."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvcli.drivers.chunked import DEFAULT_CHUNK, plan_chunking, read_in_chunks
from kvcli.drivers.compress import compress_as
from kvcli.errors import KvcliError
from kvcli.planning.planner import resolve, session_cells
from tests.conftest import EXAMPLES, tiny_session
from helpers import compression

DOC = (EXAMPLES / "solar-garden.txt").read_text()
CELL = 12_288   # K + V bytes of one f16 cell of qwen2.5-coder-0.5b (24 layers x 2 KV heads x 64)


@pytest.fixture(scope="module")
def tiny(tiny_1k):
    return tiny_1k


def test_plan_chunking_reads_it_in_chunks_when_asked_or_too_long():
    # an 8k prompt whose full cache passes the bounded-reading threshold: snapkv is bounded, expected_attention not
    assert plan_chunking(8000, 256, 32_768, compression("snapkv", 256), cell_bytes=CELL).chunk == DEFAULT_CHUNK
    assert plan_chunking(8000, 256, 32_768, compression("expected_attention", 256), cell_bytes=CELL).chunk is None
    c = plan_chunking(5000, 256, 32_768, compression("expected_attention", 1024), chunk=1024, cell_bytes=CELL)
    assert c.chunk == 1024 and c.cap == 1024 + 1024
    c = plan_chunking(40_000, 256, 32_768, compression("expected_attention", 256), cell_bytes=CELL)
    assert c.chunk == DEFAULT_CHUNK and "does not fit" in c.why


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_bounded_reading_keeps_the_budget_within_the_bound(tiny, engine):
    s = tiny_session(tiny, engine)
    toks = s.tokenize(DOC)[:400]
    cfg = resolve(tiny, "expected_attention", 48, {"window": 32})
    seen = []
    rep = read_in_chunks(s, toks, cfg, 96, planner=engine, on_step=lambda step, obs, plan: seen.append((step, obs)))
    assert len(rep.steps) >= 4 and all(st.cells_after == 48 for st in rep.steps)
    assert rep.peak_cells == max(st.cells_before for st in rep.steps) <= 48 + 96 == rep.cap
    assert session_cells(s, 0) == 48 and s.seq(0).tokens_read == 400
    assert rep.as_stats()["chunk_scoring"] == "chunk"
    for step, obs in seen:   # every step observed the chunk's own last (at most 32) queries, the newest slots
        w = min(32, rep.steps[step].tokens)
        assert obs.queries.shape[2] == w
        assert sorted(obs.query_positions) == sorted(obs.positions)[-w:]


def test_both_planners_agree_at_every_step(tiny):
    """The native and the reference planner, given the same chunk observations, keep the same entries (L1 of
    kvcli check --chunk, run below on both engines)."""
    from kvcli.planning.planner import make_plan
    s = tiny_session(tiny, "native")
    toks = s.tokenize(DOC)[:300]
    cfg = resolve(tiny, "expected_attention", 48, {"window": 32})
    steps = []

    def other(step, obs, plan):
        ref = make_plan(cfg.spec, cfg.params, 48, obs, "reference")
        steps.append(all(plan.kept(l, h).tolist() == ref.kept(l, h).tolist()
                         for l in range(s.info.n_layer) for h in range(s.info.n_head_kv)))
    read_in_chunks(s, toks, cfg, 96, planner="native", on_step=other)
    assert len(steps) >= 3 and all(steps)


def test_one_chunk_gives_the_one_prefill_plan(tiny):
    a, b = tiny_session(tiny, "native"), tiny_session(tiny, "native")
    toks = a.tokenize(DOC)[:300]
    cfg = resolve(tiny, "expected_attention", 64, {})
    one = compress_as(a, toks, cfg, planner="native")
    chunked = read_in_chunks(b, toks, cfg, len(toks), planner="native")
    assert len(chunked.steps) == 1
    for l in range(a.info.n_layer):
        for h in range(a.info.n_head_kv):
            assert one.plan.kept(l, h).tolist() == chunked.plan.kept(l, h).tolist()
    np.testing.assert_allclose(a.logits(0), b.logits(0), atol=1e-5, rtol=0)


def test_a_window_longer_than_the_chunk_takes_the_chunk(tiny):
    """expected_attention's window is a most: a chunk shorter than it gives its statistics from every query of the
    chunk. A window policy (snapkv) still refuses a window longer than the chunk."""
    s = tiny_session(tiny, "native")
    toks = s.tokenize(DOC)[:300]
    rep = read_in_chunks(s, toks, resolve(tiny, "expected_attention", 48, {}), 96, planner="native")
    assert len(rep.steps) >= 3 and session_cells(s, 0) == 48
    with pytest.raises(KvcliError, match="longer than --chunk"):
        read_in_chunks(tiny_session(tiny, "native"), toks, resolve(tiny, "snapkv", 200, {"window": 128}), 96)


def test_check_chunked_both_engines_agree(tiny):
    """kvcli check --chunk: both engines read in chunks; identical plans at every step (L1), the same end result (L3),
    the same peak cells."""
    from kvcli.commands.check import format_report
    from kvcli.drivers.check import CheckSettings, Thresholds, run_check
    settings = CheckSettings(budget=48, n_tokens=4, cache_type="f32", flash_attn=False, doc_tokens=240, chunk=96)
    r = run_check(tiny, DOC, ["expected_attention"], settings, Thresholds.tight())
    table = format_report(r)
    e = r["policies"][0]
    assert "error" not in e and e["chunks"] >= 2 and e["l1"]["pass"], table
    assert e["l3"]["pass"] and e["plans"]["jaccard_min"] == 1.0, table
    assert e["l3"]["peak_cells"][0] == e["l3"]["peak_cells"][1] <= 48 + 96, table
    assert r["passed"], table


def test_run_with_chunk_keeps_the_budget(run_kvcli, tiny_2k, word_doc):
    p = run_kvcli("run", "--model", tiny_2k, "--doc", word_doc(600), "--policy", "expected_attention", "--budget",
                  "64", "--chunk", "256", "-n", "4", "--json", "What?")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout.strip().splitlines()[-1])["stats"]
    assert st["chunks"] >= 3 and st["chunk_scoring"] == "chunk"
    assert st["peak_kv_cells"] <= st["cache_cap"] == 64 + 256
    assert max(st["per_layer_cells"]) <= 64 + 4   # the budget + the answer


def test_chat_compressed_once_in_chunks_says_so(run_kvcli, tiny_2k, word_doc):
    """kvcli chat --compress-once --chunk N: the summary line says how the document was read, and every answer's
    --json stats carry the chunked read's figures."""
    p = run_kvcli("chat", "--model", tiny_2k, "--doc", word_doc(600), "--policy", "expected_attention", "--budget",
                  "64", "--compress-once", "--chunk", "256", "-n", "3", "--json", input="Q1?\nQ2?\n")
    assert p.returncode == 0, p.stderr
    assert "chunks of 256 (at most 320 cells)" in p.stderr
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    assert len(rows) == 2 and all(r["chunks"] >= 3 and r["cache_cap"] == 320 and r["chunk_scoring"] == "chunk"
                                  for r in rows)
