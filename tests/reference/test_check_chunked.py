"""kvcli check --chunk: both engines read a document in chunks with the chunked driver (compaction with
re-indexed positions after every chunk); L1 at every planning step, L3 at the end. On the tiny float32
model with an f32 native cache and flash attention off the engines agree to float32 accuracy."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcli.drivers.check import CheckSettings, Origins, Thresholds, run_check
from kvcli.drivers.compress import prefill_and_compress, resolve
from kvcli.errors import KvcliError
from kvcli.reference.session import ReferenceSession

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "examples" / "solar-garden.txt").read_text()


class _NoReindex:
    """A reference session whose compactions keep the original positions, so kept_positions() reports the
    original prompt positions the Origins tracker must reproduce."""

    def __init__(self, session):
        self._s = session

    def __getattr__(self, name):
        return getattr(self._s, name)

    def apply_plan(self, plan, seq=0, reindex=False):
        self._s.apply_plan(plan, seq=seq)


@pytest.mark.parametrize("policy", ["snapkv", "h2o"])
def test_origins_follow_the_slots_through_chunked_compactions(tiny_gguf, policy):
    ref = ReferenceSession(tiny_gguf)
    toks = ref.tokenize(DOC)[:300]
    origins = Origins(ref.info.n_layer, ref.info.n_head_kv)
    rep = prefill_and_compress(_NoReindex(ref), toks, resolve(ref.model_path, policy, 40, {}), chunk=80,
                               planner="reference",
                               on_step=lambda step, obs, plan: origins.on_plan(obs.n, plan, reindexed=False))
    assert len(rep.steps) >= 3
    want = ref.kept_positions()
    got = origins.kept(ref.stats()["kv_cells"])
    for l in range(ref.info.n_layer):
        for h in range(ref.info.n_head_kv):
            assert got[l][h].tolist() == want[l][h].tolist(), (l, h)
    assert max(len(h) for layer in got for h in layer) <= 40 and origins.consumed == len(toks)


def test_check_chunked_on_tiny_model_tight(tiny_gguf, monkeypatch):
    """A document of 4 chunks: every planning step gives identical plans (L1) and the end results agree to
    float32 accuracy (L3), for a window policy (scored by the question probe, rolled back in both engines),
    an accumulated-attention policy and a positional one. The compressions the command resolved are the ones read
    with (issue #65): nothing resolves a policy again."""
    from kvcli.drivers.check import resolve_policies
    import kvcli.drivers.compress as compress_driver
    import kvcli.planning.planner as planner
    names = ["snapkv", "h2o", "streamingllm"]
    settings = CheckSettings(budget=48, n_tokens=8, cache_type="f32", flash_attn=False, doc_tokens=320, chunk=96)
    resolved = resolve_policies(tiny_gguf, names, settings.budget)

    def again(*a, **kw):
        raise AssertionError(f"a policy resolved again: {a[1:3]}")
    monkeypatch.setattr(compress_driver, "resolve", again)
    monkeypatch.setattr(planner, "resolve", again)
    r = run_check(tiny_gguf, DOC, names, settings, Thresholds.tight(), resolved=resolved)
    from kvcli.commands.check import format_report
    table = format_report(r)
    assert r["l2"]["pass"] and r["l2"]["tokens"] == 96, table
    for e in r["policies"]:
        assert "error" not in e, table
        assert e["chunks"] >= 3 and e["l1"]["steps"] >= 3 and e["l1"]["pass"], table
        l3, plans = e["l3"], e["plans"]
        assert l3["pass"] and l3["greedy_agree"] == 1.0, table
        assert plans["pass"] and plans["jaccard_min"] >= 0.95 and plans["greedy_agree"] == 1.0, table
        assert l3["peak_cells"][0] == l3["peak_cells"][1] <= 48 + 96, table
        assert e["steps"] == l3["reference_steps"] == plans["reference_steps"], table
    assert r["passed"] and "chunks of 96" in table


def test_check_chunked_on_tiny_sliding_model_tight(tmp_path):
    """A model with sliding-window layers (gemma3: layers 0 and 2 slide over 32 tokens) is read in chunks without
    re-indexing, in both engines: identical plans at every step on its 2 global layers, the same end result.
    Its reference model computes GELU as llama.cpp's CPU backend does (test_reference_architectures.py says why)."""
    from kvcli.commands.check import format_report
    from kvcli.reference.model import load
    from kvcli.reference.llamacpp_arithmetic import use_ggml_cpu_gelu
    from kvcli.testing.tiny_gguf import write_tiny
    path = write_tiny(tmp_path / "gemma3.gguf", "gemma3", n_layer=4, sliding_window=32, swa_pattern=2)
    use_ggml_cpu_gelu(load(path).model)
    settings = CheckSettings(budget=48, n_tokens=8, cache_type="f32", flash_attn=False, doc_tokens=320, chunk=96)
    r = run_check(path, DOC, ["snapkv", "h2o", "streamingllm"], settings, Thresholds.tight())
    table = format_report(r)
    assert r["l2"]["pass"], table
    for e in r["policies"]:
        assert "error" not in e, table
        assert e["chunks"] >= 3 and e["l1"]["steps"] >= 3 and e["l1"]["pass"], table
        l3 = e["l3"]
        assert l3["pass"] and l3["greedy_agree"] == 1.0 and len(e["plans"]["jaccard_per_layer"]) == 2, table
        assert e["plans"]["pass"] and e["steps"] == l3["reference_steps"], table
    assert r["passed"], table


def test_check_chunked_bad_input(tiny_gguf):
    with pytest.raises(KvcliError, match="fits in one chunk"):
        run_check(tiny_gguf, DOC, ["snapkv"], CheckSettings(budget=48, doc_tokens=100, chunk=512))
    with pytest.raises(KvcliError, match="compressing policy"):
        run_check(tiny_gguf, DOC, ["full"], CheckSettings(budget=48, doc_tokens=300, chunk=96))
    with pytest.raises(KvcliError, match="at least"):
        run_check(tiny_gguf, DOC, ["snapkv"], CheckSettings(budget=48, chunk=8))
