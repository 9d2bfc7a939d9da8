"""kvzip under bounded (chunked) reading (issue #32): after every chunk its reconstruction pass runs over that chunk
only (kvcli/policies/reconstruction.py, start/end), every held slot scored by the pass's column maxima, a kept entry
keeping the larger of its earlier maximum and the new one; the cache never holds more than budget + chunk + one
pass; the pass's seconds are reported on their own. A prompt read in one chunk gives the one-prefill plan."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvcli.drivers.chunked import DEFAULT_CHUNK, _carry, plan_chunking, read_in_chunks
from kvcli.drivers.compress import compress_as
from kvcli.policies.reconstruction import pass_cells, passes, repeat_room
from kvcli.errors import KvcliError
from kvcli.planning.planner import resolve, session_cells
from kvcli.policies.kvzip import REPEAT_CHUNK, REPEAT_FIRST
from tests.conftest import EXAMPLES, tiny_session
from helpers import compression

DOC = (EXAMPLES / "solar-garden.txt").read_text()
CELL = 12_288   # K + V bytes of one f16 cell of qwen2.5-coder-0.5b (24 layers x 2 KV heads x 64)


@pytest.fixture(scope="module")
def tiny(tiny_1k):
    return tiny_1k


def _watch_cells(s):
    """Record the cells the sequence holds after every prefill (chunks, reconstruction passes, re-decodes)."""
    held, orig = [], s.prefill

    def prefill(ids, *a, **k):
        out = orig(ids, *a, **k)
        held.append(session_cells(s, k.get("seq", 0)))
        return out
    s.prefill = prefill
    return held


@pytest.mark.parametrize("engine", ["native", "reference"])
def test_bounded_kvzip_keeps_the_budget_within_the_bound(tiny, engine):
    s = tiny_session(tiny, engine)
    toks = s.tokenize(DOC)[:400]
    held = _watch_cells(s)
    cfg = resolve(tiny, "kvzip", 48, {})
    rep = read_in_chunks(s, toks, cfg, 96, planner=engine)
    bound = 48 + 96 + pass_cells(s, REPEAT_CHUNK, 96)
    assert len(rep.steps) >= 4 and all(st.cells_after == 48 for st in rep.steps)
    assert max(st.cells_before for st in rep.steps) <= 48 + 96
    # the cells really held (a pass on top of the kept entries + the chunk) never pass the bound, and the report
    # says the most it held
    assert max(held) == rep.peak_cells <= rep.cap == bound
    assert session_cells(s, 0) == 48 and s.seq(0).tokens_read == 400
    st = rep.as_stats()
    assert st["reconstruct_s"] > 0 and rep.compress_s >= rep.reconstruct_s
    assert st["chunk_scoring"] == "reconstruction" and st["cache_cap"] == bound and st["chunks"] == len(rep.steps)
    if engine == "native":   # the last pass is followed by the prompt's last token again: its logits are there
        assert np.isfinite(s.logits(0)).all()


def test_kept_entries_carry_their_larger_maximum(tiny):
    """Every step's scores of the kept slots are at least what they carried from the steps before (max of old and
    new); the new chunk's pass adds to them somewhere (the kept entries compete with the new chunk on both)."""
    s = tiny_session(tiny, "native")
    toks = s.tokenize(DOC)[:400]
    seen = []
    read_in_chunks(s, toks, resolve(tiny, "kvzip", 48, {}), 96, planner="native",
                   on_step=lambda step, obs, plan: seen.append((obs.colmax.copy(), plan)))
    assert len(seen) >= 4
    group = s.info.n_head // s.info.n_head_kv
    raised = 0
    for (prev, plan), (now, _) in zip(seen, seen[1:]):
        carried = _carry(prev, plan, group, True)
        k = carried.shape[2]
        assert (now[:, :, :k] >= carried).all()
        raised += int((now[:, :, :k] > carried).sum())
    assert raised > 0


def test_one_chunk_gives_the_one_prefill_plan(tiny):
    """Read in one chunk, the reading is the one-prefill kvzip: the same passes, the same maxima, the same plan."""
    a, b = tiny_session(tiny, "native"), tiny_session(tiny, "native")
    toks = a.tokenize(DOC)[:300]
    cfg = resolve(tiny, "kvzip", 64, {})
    got = {}
    one = compress_as(a, toks, cfg, planner="native", on_step=lambda step, obs, plan: got.setdefault("one", obs))
    chunked = read_in_chunks(b, toks, cfg, len(toks), planner="native",
                             on_step=lambda step, obs, plan: got.setdefault("chunked", obs))
    assert len(chunked.steps) == 1
    np.testing.assert_array_equal(got["one"].colmax, got["chunked"].colmax)
    for l in range(a.info.n_layer):
        for h in range(a.info.n_head_kv):
            assert one.plan.kept(l, h).tolist() == chunked.plan.kept(l, h).tolist()
    np.testing.assert_allclose(a.logits(0), b.logits(0), atol=1e-5, rtol=0)
    # both report the cells the reconstruction pass held on top of the prompt
    assert one.peak_cells == chunked.peak_cells == 300 + len(a.tokenize(REPEAT_FIRST)) + 300


def test_later_chunks_are_introduced_by_the_tokens_before_them(tiny):
    s = tiny_session(tiny, "native")
    toks = s.tokenize(DOC)[:300]
    first, nxt = s.tokenize("\n\nRepeat the previous context exactly."), \
        s.tokenize("\n\nRepeat the part of the previous context exactly, starting with")
    assert passes(s, toks, 2048, 0, 96) == [first + toks[:96]]
    assert passes(s, toks, 2048, 96, 192) == [nxt + toks[88:96] + toks[96:192]]
    assert passes(s, toks, 64, 96, 192) == [nxt + toks[88:96] + toks[96:160], nxt + toks[152:160] + toks[160:192]]


def test_plan_chunking_reads_kvzip_bounded():
    """kvzip reads in chunks when asked (--chunk N, --max-cache) or when the prompt is longer than the context, its
    context holding budget + chunk + one pass over a chunk; under --max-cache the chunk leaves the pass its room.
    Bounded reading does not turn on by itself for it (its quality figures are the one-prefill pass's)."""
    c = plan_chunking(8000, 256, 32_768, compression("kvzip", 256), cell_bytes=CELL)
    assert c.chunk is None and c.n_ctx >= 8000 + repeat_room(8000, REPEAT_CHUNK)
    assert plan_chunking(8000, 256, 32_768, compression("snapkv", 256), cell_bytes=CELL).chunk == DEFAULT_CHUNK
    c = plan_chunking(40_000, 256, 32_768, compression("kvzip", 256), cell_bytes=CELL)
    assert c.chunk == DEFAULT_CHUNK and c.cap == 256 + DEFAULT_CHUNK and "does not fit" in c.why
    assert c.n_ctx >= 256 + DEFAULT_CHUNK + repeat_room(DEFAULT_CHUNK, REPEAT_CHUNK)
    assert c.n_ctx < 8000     # sized for the chunk's pass, not the prompt's
    c = plan_chunking(5000, 256, 32_768, compression("kvzip", 1024), chunk=1024, cell_bytes=1 << 20)
    assert c.chunk == 1024 and c.n_ctx >= 1024 + 1024 + repeat_room(1024, REPEAT_CHUNK)
    c = plan_chunking(8000, 64, 32_768, compression("kvzip", 256), max_cache=1536, cell_bytes=CELL)
    assert c.n_ctx == 1536 and 256 + c.chunk + repeat_room(c.chunk, REPEAT_CHUNK) <= 1536
    assert c.chunk >= (1536 - 256 - 64) // 2 - 1
    with pytest.raises(KvcliError, match="reconstruction pass"):
        plan_chunking(8000, 64, 32_768, compression("kvzip", 256), max_cache=256 + 150, cell_bytes=CELL)
    # --chunk 0 and short prompts: the one-prefill pass, room for it after the prompt
    c = plan_chunking(8000, 256, 32_768, compression("kvzip", 256), chunk=0, cell_bytes=CELL)
    assert c.chunk is None and c.n_ctx >= 8000 + repeat_room(8000, REPEAT_CHUNK)


def test_run_with_chunk_reports_the_reconstruction(run_kvcli, tiny_2k, word_doc):
    p = run_kvcli("run", "--model", tiny_2k, "--doc", word_doc(600), "--policy", "kvzip", "--budget", "64",
                  "--chunk", "256", "-n", "4", "--json", "What?")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout.strip().splitlines()[-1])["stats"]
    assert st["chunks"] >= 3 and st["chunk_scoring"] == "reconstruction" and st["reconstruct_s"] > 0
    assert st["compress_s"] >= st["reconstruct_s"]
    assert 64 + 256 < st["peak_kv_cells"] <= st["cache_cap"] < 64 + 256 + 256 + 64
    assert max(st["per_layer_cells"]) <= 64 + 4   # the budget + the answer


def test_check_chunked_kvzip_both_engines_agree(tiny):
    """kvcli check --chunk: both engines read in chunks with the reconstruction pass after each: identical plans at
    every step (L1), the same end result (L3), the same peak cells."""
    from kvcli.commands.check import format_report
    from kvcli.drivers.check import CheckSettings, Thresholds, run_check
    settings = CheckSettings(budget=48, n_tokens=4, cache_type="f32", flash_attn=False, doc_tokens=240, chunk=96)
    r = run_check(tiny, DOC, ["kvzip"], settings, Thresholds.tight())
    table = format_report(r)
    e = r["policies"][0]
    assert "error" not in e and e["chunks"] >= 2 and e["l1"]["pass"], table
    assert e["l3"]["pass"] and e["plans"]["jaccard_min"] == 1.0, table
    assert e["l3"]["peak_cells"][0] == e["l3"]["peak_cells"][1] > 48 + 96, table
    assert r["passed"], table


def test_pass_decoded_in_short_calls_gives_the_same_maxima(tiny, monkeypatch):
    """Bounded reading decodes a pass in calls of `pass_rows` tokens (the observation's softmax rows bound the compute
    buffer): the maxima over the calls are those of one call per pass."""
    from kvcli.policies import reconstruction as R
    s = tiny_session(tiny, "native")
    toks = s.tokenize(DOC)[:300]
    s.prefill(toks)
    assert R.pass_rows(s) == 512
    whole = R.reconstruct_scores(s, toks, 0, 2048).colmax
    monkeypatch.setattr(R, "PASS_ROWS_BYTES", 40 * 1024 * s.info.n_head * 4)   # 40 rows over 1,024 cells
    assert R.pass_rows(s) == 40
    split = R.reconstruct_scores(s, toks, 0, 2048, rows=R.pass_rows(s))
    np.testing.assert_allclose(split.colmax, whole, rtol=1e-5, atol=1e-7)
    assert split.longest == len(passes(s, toks, 2048)[0]) and s.seq(0).cells == 300
