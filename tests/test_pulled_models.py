"""The models `kvcli models pull` installs, end to end (slow; each skips when its model is not pulled)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcli import catalogue, policies

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "examples" / "solar-garden.txt"
LONG_DOC = ROOT / "examples" / "station-log.txt"


def pulled(name: str) -> Path:
    path = catalogue.pulled_path(name)
    if not path.is_file():
        pytest.skip(f"{name} is not pulled (kvcli models pull {name})")
    return path


@pytest.mark.slow
def test_qwen_run_snapkv_keeps_the_budget(run_kvcli):
    pulled("qwen2.5-coder-0.5b")
    r = run_kvcli("run", "--model", "qwen2.5-coder-0.5b", "--doc", DOC, "--policy", "snapkv", "--budget", "128",
                  "--json", "-n", "48", "How much did the project cost?", timeout=1800)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    s = out["stats"]
    assert out["answer"].strip() and s["prompt_tokens"] > 1000
    assert s["kv_cells"] <= 128 + s["generated_tokens"]


@pytest.mark.slow
def test_qwen_check_passes_l1_l3_for_every_policy():
    pulled("qwen2.5-coder-0.5b")
    from kvcli.check import CheckSettings, Thresholds, run_check
    from kvcli.commands.check import format_report
    both = [n for n, s in policies.REGISTRY.items() if s.native and s.reference]
    r = run_check(catalogue.pulled_path("qwen2.5-coder-0.5b"), DOC.read_text(), both,
                  CheckSettings(budget=64, n_tokens=8, doc_tokens=1000), Thresholds())
    table = format_report(r)
    for e in r["policies"]:
        assert "error" not in e and e["l1"]["pass"] and e["l3"]["pass"], table


@pytest.mark.slow
def test_gemma_run_compresses_the_global_layers(run_kvcli, tmp_path):
    """gemma-3-270m: 15 of its 18 layers slide over 512 tokens (llama.cpp's window cache, left whole); snapkv at
    128 compresses the 3 global layers of a 2k-token document."""
    pulled("gemma-3-270m")
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(LONG_DOC.read_text().split()[:1500]))
    r = run_kvcli("run", "--model", "gemma-3-270m", "--doc", doc, "--policy", "snapkv", "--budget", "128",
                  "--json", "-n", "16", "What happened on the station?", timeout=1800)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["stats"]
    assert s["prompt_tokens"] > 1800 and s["kv_cells"] <= 128 + s["generated_tokens"]
    assert s["sliding_layers"] == [il for il in range(18) if il % 6 != 5] and s["sliding_window"] == 512
    for il in (5, 11, 17):
        assert s["per_layer_cells"][il] <= 128 + s["generated_tokens"]
    assert all(512 <= s["per_layer_cells"][il] < s["prompt_tokens"] for il in s["sliding_layers"])


@pytest.mark.slow
def test_gemma_check_passes():
    """kvcli check on gemma-3-270m and a 2k-token document, every level, snapkv and pyramidkv: identical plans (L1),
    the engines' observations close (L2: one K row of ~6,000 is beyond the threshold, where llama.cpp's own f32
    setting moves it four times as far; docs/models.md), both decode alike after compressing the 3 global layers
    (L3). About 3.5 min on 1 thread, most of it the reference engine."""
    pulled("gemma-3-270m")
    from kvcli.check import CheckSettings, Thresholds, run_check
    from kvcli.commands.check import format_report
    path = catalogue.pulled_path("gemma-3-270m")
    r = run_check(path, LONG_DOC.read_text(), ["snapkv", "pyramidkv"],
                  CheckSettings(budget=128, doc_tokens=2000, threads=1), Thresholds())
    table = format_report(r)
    assert r["passed"] and r["l2"]["pass"], table
    for e in r["policies"]:
        assert "error" not in e and e["l1"]["pass"] and e["l1"]["identical_budgets"], table
        assert e["l3"]["pass"] and len(e["plans"]["jaccard_per_layer"]) == 3, table
