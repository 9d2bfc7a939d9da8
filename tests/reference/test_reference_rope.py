"""RoPE as llama.cpp computes it from the file, in the reference engine (kvcli/reference/model.py).

transformers' GGUF loader reads `rope.freq_base` only: it ignores the `rope_freqs` tensor every Llama 3.x GGUF carries
(each frequency divided by its factor) and `rope.scaling.type` / `rope.scaling.factor`. On tiny random llamas with
llama3-style factors (small original context, so that they matter within 300 tokens) and with linear scaling, the
engines agree at the tight thresholds, and with YaRN, re-indexed chunked reading included (llama.cpp's K-shift
applies the same factors); without the correction they do not (the control). LongRoPE, YaRN on gemma and unknown
types are refused in one line.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcli.check import CheckSettings, Thresholds, run_check
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


REFUSED = {
    "yarn-gemma3": (dict(arch="gemma3", n_layer=4, rope_scaling=YARN),
                    "YaRN RoPE scaling is not supported by the reference engine for gemma3"),
    "longrope": (dict(arch="phi3", rope_scaling={"type": "longrope", "original_context_length": 512,
                                                 "attn_factor": 1.2},
                      rope_tensors={"rope_factors_long": [1.0, 2, 4, 8, 8, 8, 8, 8],
                                    "rope_factors_short": [1.0, 1, 1, 2, 2, 2, 2, 2]}),
                 "LongRoPE scaling (rope_factors_long/short) is not supported by the reference engine"),
}


@pytest.mark.parametrize("kind", list(REFUSED))
def test_reference_refuses_longrope_and_gemma_yarn_the_native_engine_runs_them(tmp_path, run_kvcli, kind):
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
