"""Every architecture kvcli accepts, on tiny random GGUFs written here: the two engines agree (L1 plans,
L2 observation, L3 compacted decoding) at float32 accuracy, as on the tiny llama of test_check_levels.py.

qwen2 adds Q/K/V projection biases, qwen3 RMS-normalises each head's Q and K before RoPE, phi3 fuses QKV
and gate/up; all three rotate with NEOX RoPE, so their K rows are in the same order in both engines.
gemma2 and gemma3 have sliding-window layers (here layers 0 and 2 slide over 32 tokens of a 300-token document;
1 and 3 are global and the only ones compressed), gemma2 soft-caps its attention scores (cap 4 in the tiny model)
and both have GELU FFNs: their reference models compute GELU as llama.cpp's CPU backend does
(kvcli.reference.llamacpp_arithmetic: an f16 table), or the engines would differ by ~2e-4 before kvcli does anything.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcli import policies
from kvcli.drivers.check import CheckSettings, Thresholds, run_check
from kvcli.testing.tiny_gguf import ARCHITECTURES, SLIDING, write_tiny

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "examples" / "solar-garden.txt").read_text()
BOTH = [name for name, spec in policies.REGISTRY.items() if spec.native and spec.reference]
SHAPES = {arch: dict(n_layer=4, sliding_window=32, swa_pattern=2) for arch in SLIDING}


def tiny_model(tmp_path_factory, arch):
    """The tiny model of `arch`, its reference model with llama.cpp's CPU GELU where it has a GELU FFN."""
    from kvcli.reference.model import load
    from kvcli.reference.llamacpp_arithmetic import use_ggml_cpu_gelu
    path = write_tiny(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch, **SHAPES.get(arch, {}))
    if arch in SLIDING:   # the gemmas: GELU FFNs
        use_ggml_cpu_gelu(load(path).model)   # the model object every ReferenceSession of this file shares
    return path


# llama: test_check_levels.py
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a != "llama"])
def test_engines_agree_on_tiny_model(tmp_path_factory, arch):
    from kvcli.commands.check import format_report
    path = tiny_model(tmp_path_factory, arch)
    settings = CheckSettings(budget=96, n_tokens=8, cache_type="f32", flash_attn=False, doc_tokens=300)
    r = run_check(path, DOC, BOTH, settings, Thresholds.tight())
    table = format_report(r)
    assert r["l2"]["pass"], table
    checked = [e for e in r["policies"] if "skipped" not in e]
    # kvzip's reconstruction pass cannot be rolled back through a window cache, expected_attention cannot undo a RoPE
    # whose base differs per layer kind: both skipped on the sliding-window models (phi3, whose Q rows llama.cpp scales
    # before attention, is checked: the native observation undoes the scale)
    skipped = ["kvzip", "expected_attention"] if arch in SLIDING else []
    assert [e["policy"] for e in r["policies"] if "skipped" in e] == skipped, table
    for e in checked:
        assert "error" not in e, table
        assert e["l1"]["pass"] and e["l3"]["pass"], table
        assert e["l3"]["greedy_agree"] == 1.0, table
    assert r["passed"], table
    if arch in SLIDING:   # the plans, observations and kept positions cover the two global layers
        assert r["prompt_tokens"] > 32 * 4
        assert all(len(e["plans"]["jaccard_per_layer"]) == 2 for e in checked), table
