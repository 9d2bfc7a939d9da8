"""Every architecture kvcli accepts, on tiny random GGUFs written here: the two engines agree (L1 plans,
L2 observation, L3 compacted decoding) at float32 accuracy, as on the tiny llama of test_check_levels.py.

qwen2 adds Q/K/V projection biases, qwen3 RMS-normalises each head's Q and K before RoPE, phi3 fuses QKV
and gate/up; all three rotate with NEOX RoPE, so their K rows are in the same order in both engines.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from kvcli import policies
from kvcli.check import CheckSettings, Thresholds, run_check
from kvcli.testing.tiny_gguf import ARCHITECTURES, write_tiny

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "examples" / "solar-garden.txt").read_text()
BOTH = [name for name, spec in policies.REGISTRY.items() if spec.native and spec.reference]


# llama: test_check_levels.py; gemma2/gemma3 (sliding-window layers) run in the native engine only:
# tests/native/test_iswa.py and test_gemma2.py check them against a numpy forward pass
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in ("llama", "gemma2", "gemma3")])
def test_engines_agree_on_tiny_model(tmp_path_factory, arch):
    from kvcli.commands.check import format_report
    path = write_tiny(tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf", arch)
    settings = CheckSettings(budget=96, n_tokens=8, cache_type="f32", flash_attn=False, doc_tokens=300)
    r = run_check(path, DOC, BOTH, settings, Thresholds.tight())
    table = format_report(r)
    assert r["l2"]["pass"], table
    for e in r["policies"]:
        assert "error" not in e, table
        assert e["l1"]["pass"] and e["l3"]["pass"], table
        assert e["l3"]["greedy_agree"] == 1.0, table
    assert r["passed"], table
