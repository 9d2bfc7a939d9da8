"""RoPE as llama.cpp computes it from the file, in the reference engine (kvcli/reference/model.py).

transformers' GGUF loader reads `rope.freq_base` only: it ignores the `rope_freqs` tensor every Llama 3.x GGUF carries
(each frequency divided by its factor) and `rope.scaling.type` / `rope.scaling.factor`. On tiny random llamas with
llama3-style factors (small original context, so that they matter within 300 tokens) and with linear scaling, the
engines agree at the tight thresholds, and with YaRN, re-indexed chunked reading included (llama.cpp's K-shift
applies the same factors); without the correction they do not (the control). phi3's LongRoPE: the engines agree with
the short factors (a context within the original one) and the long ones (a larger context), and not with the other
pair (the control). YaRN on gemma and unknown types are refused in one line.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcli.drivers.check import CheckSettings, Thresholds, run_check
from kvcli.errors import KvcliError
from kvcli.testing.tiny_gguf import llama3_rope_freqs, write_tiny

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "examples" / "solar-garden.txt").read_text()
POLICIES = ["snapkv", "h2o", "pyramidkv"]
FREQS = {"rope_freqs": llama3_rope_freqs(16)}          # 1, 1.29, 7.67, then 8 for the 5 lowest frequencies
# YaRN with an original context of 64: the ramp between extrapolated and interpolated frequencies covers pairs 0-3
YARN = {"type": "yarn", "factor": 4.0, "original_context_length": 64, "attn_factor": 1.1}
VARIANTS = {
    "rope_freqs": dict(rope_tensors=FREQS),
    "linear": dict(rope_scaling={"type": "linear", "factor": 4.0}),
    "rope_freqs+linear+attn_factor": dict(rope_tensors=FREQS,
                                          rope_scaling={"type": "linear", "factor": 4.0, "attn_factor": 1.2}),
    "yarn": dict(rope_scaling=YARN),
}
SETTINGS = CheckSettings(budget=96, n_tokens=8, cache_type="f32", flash_attn=False, doc_tokens=300)


def tight_report(r) -> str:
    from kvcli.commands.check import format_report
    return format_report(r)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_engines_agree_with_scaled_rope(tmp_path, variant):
    path = write_tiny(tmp_path / "tiny.gguf", "llama", **VARIANTS[variant])
    r = run_check(path, DOC, POLICIES, SETTINGS, Thresholds.tight())
    table = tight_report(r)
    assert r["l2"]["pass"] and r["l2"]["keys"]["rel"] <= 1e-4, table
    for e in r["policies"]:
        assert "error" not in e, table
        assert e["l1"]["pass"] and e["l3"]["pass"] and e["l3"]["greedy_agree"] == 1.0, table
    assert r["passed"], table


@pytest.mark.parametrize("variant", ["rope_freqs", "linear", "yarn"])
def test_without_the_correction_the_engines_disagree(tmp_path, monkeypatch, variant):
    """The control: a reference model that takes RoPE as transformers' GGUF mapping gives it (no factors, no
    scaling) rotates K differently from llama.cpp by far more than the tight thresholds allow."""
    from kvcli.reference import model as ref_model
    path = write_tiny(tmp_path / "tiny.gguf", "llama", **VARIANTS[variant])
    monkeypatch.setattr(ref_model, "_apply_file_rope", lambda model, info: None)
    monkeypatch.setattr(ref_model, "_rope_parameters",
                        lambda info: {"rope_type": "default", "rope_theta": float(info.rope_theta)})
    r = run_check(path, DOC, ["snapkv"], SETTINGS, Thresholds.tight())
    assert not r["l2"]["pass"] and r["l2"]["keys"]["rel"] > 0.1, tight_report(r)


@pytest.mark.parametrize("variant", ["rope_freqs+linear+attn_factor", "yarn"])
def test_chunked_reading_with_scaled_rope(tmp_path, variant):
    """Chunked reading re-indexes the kept entries after every chunk: llama.cpp's K-shift (build_rope_shift, run
    by kvcli_reindex.cpp) re-rotates K with the model's rope_freqs, scaling and mscale, the reference with the same
    rotary embedding (KeyRotation: the mscale applied again, as llama.cpp does)."""
    path = write_tiny(tmp_path / "tiny.gguf", "llama", **VARIANTS[variant])
    settings = CheckSettings(budget=48, n_tokens=8, cache_type="f32", flash_attn=False, doc_tokens=320, chunk=96)
    r = run_check(path, DOC, ["snapkv", "h2o"], settings, Thresholds.tight())
    table = tight_report(r)
    for e in r["policies"]:
        assert "error" not in e, table
        assert e["chunks"] >= 3 and e["l1"]["steps"] >= 3 and e["l1"]["pass"], table
        assert e["l3"]["pass"] and e["l3"]["greedy_agree"] == 1.0, table
    assert r["passed"], table


# phi3's LongRoPE pair (Phi-3/3.5 128k): llama.cpp divides each frequency by the long factors in a context of more
# cells than the original context, by the short ones otherwise; Phi's converter writes rope.scaling.attn_factor
LONGROPE = {"rope_factors_long": [1.0, 1.5, 2, 4, 8, 8, 8, 8], "rope_factors_short": [1.0, 1, 1.2, 1.5, 2, 2, 2, 2]}
# the check's context holds the 300-token document and the answer (512 cells): long factors above an original
# context of 128, short ones within 2048
LONGROPE_REGIMES = {"short": 2048, "long": 128}


def write_longrope(path, orig: int, **kwargs) -> Path:
    return write_tiny(path, "phi3", rope_scaling={"original_context_length": orig, "attn_factor": 1.2},
                      rope_tensors=LONGROPE, **kwargs)


@pytest.mark.parametrize("regime", list(LONGROPE_REGIMES))
def test_engines_agree_with_longrope(tmp_path, regime):
    from kvcli.models import longrope
    path = write_longrope(tmp_path / "phi3.gguf", LONGROPE_REGIMES[regime])
    r = run_check(path, DOC, POLICIES, SETTINGS, Thresholds.tight())
    table = tight_report(r)
    assert longrope(path).regime(r["n_ctx"]) == regime, r["n_ctx"]
    assert r["l2"]["pass"] and r["l2"]["keys"]["rel"] <= 1e-4, table
    for e in r["policies"]:
        assert "error" not in e, table
        assert e["l1"]["pass"] and e["l3"]["pass"] and e["l3"]["greedy_agree"] == 1.0, table
    assert r["passed"], table


@pytest.mark.parametrize("regime", list(LONGROPE_REGIMES))
def test_longrope_with_the_other_factors_the_engines_disagree(tmp_path, monkeypatch, regime):
    """The control: a reference engine that took the other pair of factors than llama.cpp does for the context."""
    from kvcli.models import LongRope
    path = write_longrope(tmp_path / "phi3.gguf", LONGROPE_REGIMES[regime])
    monkeypatch.setattr(LongRope, "factors", lambda self, n_ctx: self.short if self.regime(n_ctx) == "long"
                        else self.long)
    r = run_check(path, DOC, ["snapkv"], SETTINGS, Thresholds.tight())
    assert not r["l2"]["pass"] and r["l2"]["keys"]["rel"] > 0.01, tight_report(r)


def test_chunked_reading_with_longrope(tmp_path):
    """A document longer than the original context, read in chunks into a context within it: re-indexing keeps the
    positions below the context's cells, so the short factors cover them (what the native guard's message advises);
    the K-shift uses the same factors in both engines."""
    from kvcli.models import longrope
    path = write_longrope(tmp_path / "phi3.gguf", 256)
    settings = CheckSettings(budget=48, n_tokens=8, cache_type="f32", flash_attn=False, doc_tokens=320, chunk=96)
    r = run_check(path, DOC, ["snapkv", "h2o"], settings, Thresholds.tight())
    table = tight_report(r)
    assert longrope(path).regime(r["n_ctx"]) == "short" and r["prompt_tokens"] > 256, (r["n_ctx"], r["prompt_tokens"])
    for e in r["policies"]:
        assert "error" not in e, table
        assert e["chunks"] >= 3 and e["l1"]["pass"] and e["l3"]["pass"] and e["l3"]["greedy_agree"] == 1.0, table
    assert r["passed"], table


REFUSED = {
    "yarn-gemma3": (dict(arch="gemma3", n_layer=4, rope_scaling=YARN),
                    "YaRN RoPE scaling is not supported by the reference engine for gemma3"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_reference_refuses_gemma_yarn_the_native_engine_runs_it(tmp_path, run_kvcli, kind):
    kwargs, message = REFUSED[kind]
    path = write_tiny(tmp_path / f"{kind}.gguf", kwargs.pop("arch", "llama"), **kwargs)
    for args in (["run", "--engine", "reference", "-n", "2", "Hello"],
                 ["check", "--policy", "snapkv", "--budget", "48", "--doc-tokens", "64", "-n", "2"]):
        p = run_kvcli(*args, "--model", path, input="The sun is bright today.")
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0] and path.name in lines[0], p.stderr
    p = run_kvcli("run", "--model", path, "-n", "2", "--json", "Hello", input="The sun is bright today.")
    assert p.returncode == 0, p.stderr


def test_unknown_scaling_type_is_refused_by_both_engines(tmp_path, run_kvcli):
    """llama.cpp aborts on a `rope.scaling.type` it does not know (GGML_ASSERT): kvcli refuses the file first."""
    path = write_tiny(tmp_path / "odd.gguf", "llama", rope_scaling={"type": "dynamic", "factor": 2.0})
    for engine in ("native", "reference"):
        p = run_kvcli("run", "--engine", engine, "--model", path, "-n", "2", "Hello", input="The sun is bright.")
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
        assert "unknown RoPE scaling type 'dynamic'" in p.stderr, p.stderr


def test_rope_freqs_of_the_wrong_length_is_refused(tmp_path):
    from kvcli.reference.model import load
    path = write_tiny(tmp_path / "bad.gguf", "llama", rope_tensors={"rope_freqs": [1.0, 2.0, 4.0]})
    with pytest.raises(KvcliError, match="rope_freqs has 3 factors, not head_dim / 2 = 8"):
        load(path)
